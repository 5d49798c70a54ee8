"""ModelRunner: one rank's model, weights, KV cache and fused-op kernel; ForwardBatch in, logits out.

The runner sizes the paged KV cache (``glm_fused.kv_cache``): after the weights and the fused
op's workspace, it profiles a forward on a GPU, agrees on a block count with the other ranks,
and settles ``args.max_model_len`` and ``args.num_kv_blocks`` for the engine.

Written once for both frameworks: ``args.backend`` names the framework, whose layer classes
(its ``LAYERS``, ``glm_fused.model.bind``) build the model and whose ops (``F``) do the tensor work.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from glm_fused import kv_cache
from glm_fused.backends import get_backend
from glm_fused.batch import ForwardBatch, slot_block_tables
from glm_fused.comm import device_index, device_kind, shares_gpu
from glm_fused.config import Glm4MoeConfig
from glm_fused.engine.sampling import SamplingBatch
from glm_fused.engine_args import EngineArgs
from glm_fused.errors import UserError
from glm_fused.fused_op import setup_fusion
from glm_fused.fused_op.policy import DTYPE_BYTES
from glm_fused.kv_cache import GiB
from glm_fused.model.loader import dummy_weights, load_weights
from glm_fused.quantization import scheme_for

log = logging.getLogger("glm_fused.runner")


@dataclass
class StepOutput:
    """One step's results on rank 0, as numpy: the sampled tokens ``[S]`` (None when the step
    sampled nothing), and when asked for, ``logprobs`` of the sampled rows and
    ``prompt_logprobs`` of the step's prompt rows (``SamplingBatch.prompt_rows``), each
    ``(logprob of the token [R], top-N ids [R, N], top-N logprobs [R, N])``."""

    tokens: np.ndarray | None
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class StepResult:
    """What ``execute`` hands back at once: call it for the step's ``StepOutput`` (rank 0; None
    elsewhere), which waits for the results only; then ``device_seconds`` is the step's
    forward and LM head as the device ran them (events around them: the bound the engine's
    step time is held to)."""

    def __init__(self, fetch, marks=None, F=None):
        self._fetch, self._marks, self._F = fetch, marks, F

    def __call__(self) -> StepOutput | None:
        return self._fetch()

    @property
    def timed(self) -> bool:
        return self._marks is not None

    @property
    def device_seconds(self) -> float | None:
        return None if self._marks is None else self._F.elapsed(*self._marks)


def _run_of(indices: np.ndarray) -> slice | None:
    """``indices`` as a slice when they are one ascending run (a lone sequence's rows, one
    logits row): the device indexes by it with no upload."""
    n = len(indices)
    if n and int(indices[-1]) - int(indices[0]) == n - 1 and (n == 1 or bool(np.all(np.diff(indices) == 1))):
        return slice(int(indices[0]), int(indices[0]) + n)
    return None


def weights_do_not_fit(config: Glm4MoeConfig, args: EngineArgs, tp_size: int, memory) -> UserError:
    """The one line for a model whose weights ran the GPU out of memory while they were made
    or loaded; ``memory``: (free, total) bytes before, or None."""
    experts, others = config.num_parameters()
    width = DTYPE_BYTES[args.dtype]
    fp8 = scheme_for(config, args.quantization) is not None  # routed experts in one byte a weight
    per_rank = (experts * (1 if fp8 else width) + others * width) / tp_size
    had = f"; the GPU had {memory[0] / GiB:.1f} of {memory[1] / GiB:.1f} GiB free" if memory else ""
    return UserError(f"out of {'GPU ' if memory else ''}memory loading the weights: {(experts + others) / 1e9:.1f}B "
                     f"parameters take about "
                     f"{per_rank / GiB:.1f} GiB per rank at --tp {tp_size} ({'fp8 experts, ' if fp8 else ''}"
                     f"{args.dtype}){had}: use more --tp ranks" + ("" if fp8 else " or --quantization fp8"))


def _fetch_all(tokens, logprobs, prompt_logprobs):
    """One callable that waits for every host copy and gives the ``StepOutput``."""
    def fetch() -> StepOutput:
        return StepOutput(None if tokens is None else tokens(),
                          None if logprobs is None else tuple(f() for f in logprobs),
                          None if prompt_logprobs is None else tuple(f() for f in prompt_logprobs))
    return fetch


class ModelRunner:
    """Runs on every rank after ``init_distributed``; every rank gets the same full-vocab logits."""

    def __init__(self, args: EngineArgs, config: Glm4MoeConfig, *, tp_rank: int, tp_size: int):
        if not args.resolved:
            raise ValueError("ModelRunner takes resolved settings: call EngineArgs.resolve() first")
        if args.device != device_kind():
            # The device comes from the launcher's GLM_FUSED_DEVICE; a process started without it
            # would put a GPU run's model on the CPU and say nothing.
            raise RuntimeError(f"settings say device {args.device}, but this process's GLM_FUSED_DEVICE is "
                               f"{device_kind()}: start ranks through glm_fused.launcher.launch, or set "
                               "GLM_FUSED_DEVICE and GLM_FUSED_DEVICE_ID as it does")
        layers = get_backend(args.backend).LAYERS
        F = self.F = layers.F
        self.args, self.config = args, config
        self.device = F.dist.device()
        self._memory_at_start = F.memory_info(self.device)  # (free, total) on a GPU, before anything is ours
        with F.device_scope(self.device):
            self.comm = F.dist.TPComm(tp_rank, tp_size)
        self.load_stats = None  # LoadStats of this rank's checkpoint read (None with dummy weights)
        try:
            with F.device_scope(self.device):
                self.model = layers.Glm4MoeForCausalLM(config, tp_rank=tp_rank, tp_size=tp_size, fused=args.fused,
                                                       comm=self.comm, dtype=args.dtype,
                                                       max_position=args.max_model_len, quantization=args.quantization)
            if args.load_format == "dummy":
                dummy_weights(self.model, args.seed)
            else:
                self.load_stats = load_weights(self.model, args.model_dir, progress=tp_rank == 0)
        except Exception as exc:  # noqa: BLE001 - only the allocator's "out of memory" is turned into a message
            if not F.is_out_of_memory(exc):
                raise
            raise weights_do_not_fit(config, args, tp_size, self._memory_at_start) from None
        self.model.eval()
        setup_fusion(self.comm, fused=args.fused, fusion_impl=args.fusion_impl, sm=F.gpu_sm(self.device),
                     hidden_size=config.hidden_size, dtype=args.dtype,
                     max_num_batched_tokens=args.max_num_batched_tokens, kernel_args=self._kernel_args,
                     shares_gpu=shares_gpu())
        # After the workspace (the profiled forward uses it), before the graphs (they point into the cache).
        self.kv = self._size_kv_cache()
        args.max_model_len, args.num_kv_blocks = self.kv.max_model_len, self.kv.num_blocks
        try:
            self.kv_caches = self.model.make_kv_caches(self.kv.num_blocks, args.block_size)
        except Exception as exc:  # noqa: BLE001 - as for the weights: only the allocator's "out of memory"
            if not F.is_out_of_memory(exc):
                raise
            kv = self.kv
            raise UserError(f"out of memory allocating the KV cache: {kv_cache.blocks_text(kv.num_blocks)} x "
                            f"{kv.block_size} tokens take {kv.bytes / GiB:.1f} GiB per rank ({kv.source})") from None
        # The token each sequence (its row: Sequence.row) sampled last, on the device: a later
        # step's input id -1 reads it, so the engine can schedule a step before the last one's
        # tokens reach the host.
        like = self.model.embed_tokens.weight
        self.next_tokens = F.zeros([args.max_num_seqs], "int64", like=like)
        self._staging = [F.pinned(args.max_num_seqs, "int64") for _ in range(3)]  # results in flight
        self._step = 0
        # Decode steps replay CUDA graphs where the framework has them (not with --enforce-eager);
        # after the fused all-reduce workspace (it must exist before capture) and the cache.
        self.graphs = self._capture() if not args.enforce_eager and F.can_capture(self.model) else None
        if F.compiles_kernels(self.model):
            self._warm_up()

    def _size_kv_cache(self) -> kv_cache.KVCacheSize:
        """The block count (the smallest of every rank's) and the context limit it allows."""
        a, limit = self.args, self.config.max_position_embeddings
        block_bytes = self.model.kv_cache_block_bytes(a.block_size)
        gpu_bytes = None
        if a.num_gpu_blocks_override is None and self._memory_at_start is not None:
            gpu_bytes = self._profile()
        num_blocks, source = kv_cache.count_blocks(a, limit, block_bytes, gpu_bytes)
        if self.comm.size > 1:
            num_blocks = min(self.comm.all_gather_object(num_blocks))
        return kv_cache.settle(a, limit, num_blocks, block_bytes, source)

    def _profile(self) -> int:
        """Bytes left for the KV cache on this GPU, after a forward of ``max_num_batched_tokens``
        tokens (the largest step) with logits for ``max_num_seqs`` rows (the largest decode)."""
        F, a, dev = self.F, self.args, self.device
        tokens = a.max_num_batched_tokens
        blocks = kv_cache.cdiv(tokens, a.block_size)
        batch = ForwardBatch.prefill([[0] * tokens], np.arange(blocks)[None, :])
        batch.logits_indices = np.arange(tokens - min(tokens, a.max_num_seqs), tokens)
        F.reset_peak_memory(dev)
        with F.no_grad():
            caches = self.model.make_kv_caches(blocks, a.block_size)
            like = self.model.embed_tokens.weight
            hidden = self.model(F.tensor(batch.input_ids, like), F.tensor(batch.positions, like), batch, caches)
            F.to_numpy(F.float32(self.model.compute_logits(hidden)))
        F.synchronize(dev)
        peak = F.peak_memory(dev)
        del caches, hidden
        F.empty_cache(dev)
        free_at_start, total = self._memory_at_start
        free_now, _ = F.memory_info(dev)
        # Ranks sharing one GPU load at the same time: their allocations would count as ours.
        outside = 0 if shares_gpu() else max(0, (free_at_start - free_now) - F.reserved_memory(dev))
        return kv_cache.gpu_budget(a.gpu_memory_utilization, free_at_start, total, peak, outside)

    # Token counts whose kernel variants a served step can need: the fused MoE's tile buckets
    # (1, 8, 64, 256, more) and, in each, counts that are and are not multiples of 16 (Triton
    # specialises integer arguments on that, where a kernel does not opt out). Measured without
    # it: 64 prompts of 512 tokens on a fresh server had a median TTFT of 8.9 s, the same load
    # again 1.3 s (docs/speed.md). tests/test_triton_kernels.py checks that no step compiles after.
    WARM_TOKENS = (1, 3, 8, 16, 40, 64, 100, 128, 257, 1000, 1024)

    def _warm_up(self) -> None:
        """Compile every kernel variant before serving: prompt steps of ``WARM_TOKENS`` (and of
        the step limit less one) and steps mixing decodes with a prompt chunk (2, 4, 8, ...
        decodes and the most a step can hold: the decode kernel's builds depend on their
        number). Garbage goes into blocks no sequence holds yet."""
        F, a = self.F, self.args
        limit = a.max_num_batched_tokens
        sizes = sorted({t for t in self.WARM_TOKENS if t <= limit} | {limit - 1, limit} - {0})
        bs, n_blocks = a.block_size, self.kv.num_blocks

        def table(n):
            return (np.arange(kv_cache.cdiv(n, bs)) % n_blocks)[None, :]

        def mixed(decodes):  # decodes (context 7) beside a 3-token chunk after 10 positions
            query, context = [1] * decodes + [3], [7] * decodes + [10]
            positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context, query)])
            return ForwardBatch(np.zeros(len(positions), np.int64), positions, query, context,
                                np.cumsum(query) - 1, np.concatenate([table(16)] * len(query)))

        batches = [ForwardBatch.prefill([[0] * t], table(t)) for t in sizes]
        # decode counts doubling from 2, and the most: the decode kernel's builds change with
        # the batch times the kv heads at two thresholds a factor 2 apart (kernels/decode_attention.py)
        counts = {1 << i for i in range(1, (a.max_num_seqs - 1).bit_length())} | {a.max_num_seqs - 1}
        batches += [mixed(d) for d in sorted(counts) if d >= 2 and d + 3 <= limit]
        like = self.model.embed_tokens.weight
        with F.no_grad():
            for batch in batches:
                hidden = self.model(F.tensor(batch.input_ids, like), F.tensor(batch.positions, like), batch,
                                    self.kv_caches)
                self.model.compute_logits(hidden)
        F.synchronize(self.device)

    def slot_tables(self, slots) -> np.ndarray:
        """Block tables for driving this runner with one fixed slot of ``max_model_len`` positions
        per sequence (tools and tests; needs ``num_gpu_blocks_override = args.slot_blocks()``)."""
        return slot_block_tables(slots, kv_cache.cdiv(self.args.max_model_len, self.args.block_size))

    def _kernel_args(self):
        """The fused kernel's workspace dtype and device, as torch names them (the adapter is torch)."""
        import torch

        return getattr(torch, self.args.dtype), torch.device("cuda", device_index())

    def _capture(self):
        """The decode graphs, or None (eager decode) when any rank could not capture: a kernel
        that cannot be captured is a slower server, not a dead one."""
        graphs, error = None, None
        try:
            graphs = self.F.capture_decode_graphs(self.model, self.kv_caches, self.args.max_num_seqs,
                                                  kv_cache.cdiv(self.args.max_model_len, self.args.block_size),
                                                  next_tokens=self.next_tokens)
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager decode
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            self.F.synchronize(self.device)
        ok = error is None
        if self.comm.size > 1:
            ok = self.comm.all_agree(ok)
        if not ok:
            log.warning("CUDA graphs off, decode runs eagerly: %s",
                        error or "another rank could not capture its decode graphs")
            return None
        return graphs

    # ---- one step ------------------------------------------------------------------------
    def execute(self, batch: ForwardBatch, sampling: SamplingBatch | None = None, *, sample: bool = True):
        """The engine's step: the forward, then (``sample``) one token per logits row, and the
        logprobs ``sampling`` asks for.

        The logits reach rank 0 only; rank 0 draws the tokens on its device (``sampling``: the
        rows' ``SamplingBatch``; its prompt rows are given on every rank, which all compute
        their logits) and sends them to the other ranks, and every rank keeps them in
        ``next_tokens`` by the sequence's row, where a later step's placeholder ids (-1) read them.
        Nothing waits for the device: the returned callable gives rank 0 the ``StepOutput``
        once it is on the host (None on the other ranks, or when nothing was asked).
        """
        self._check(batch)
        F = self.F
        sampling = sampling if sampling is not None else SamplingBatch()
        prompt_rows = sampling.prompt_rows
        P = len(prompt_rows)
        self.comm.stats.reset()
        with F.no_grad():
            like = self.model.embed_tokens.weight
            # Uploaded before the forward is queued: nothing after it may wait for the device.
            sampled_rows = None
            if sample:
                rows = batch.rows[batch.logits_seq]
                sampled_rows = _run_of(rows) or F.upload(rows, like)
            targets = F.upload(sampling.prompt_targets, like) if P else None
            start = F.mark(self.device)
            forward = batch
            if P:  # the prompt rows first, then the sampled rows
                rows = np.concatenate([prompt_rows, batch.logits_indices if sample else prompt_rows[:0]])
                forward = dataclasses.replace(batch, logits_indices=rows)
            hidden = self._hidden(forward)
            if not sample and not P:  # a prompt chunk: nothing to fetch, its device time still counted
                return StepResult(lambda: None, (start, F.mark(self.device)), F)
            logits = self.model.compute_logits(hidden, dst=0)
            marks = (start, F.mark(self.device))
            rank0 = self.comm.rank == 0
            tokens = None
            if sample:
                if rank0:
                    tokens = F.sample(logits[P:] if P else logits, sampling)
                else:
                    tokens = F.zeros([len(batch.logits_indices)], "int64", like=hidden)
                if self.comm.size > 1:
                    tokens = self.comm.broadcast(tokens, src=0)
                self.next_tokens[sampled_rows] = tokens
            if not rank0:
                return StepResult(lambda: None)
            self._step += 1
            fetch_tokens = logprobs = prompt_logprobs = None
            if sample:
                fetch_tokens = F.to_host_async(tokens, self._staging[self._step % len(self._staging)])
                if sampling.logprobs >= 0:
                    logprobs = [F.to_host_async(t) for t in
                                F.logprobs(logits[P:] if P else logits, tokens, sampling.logprobs)]
            if P:
                prompt_logprobs = [F.to_host_async(t) for t in
                                   F.logprobs(logits[:P], targets, max(sampling.prompt_logprobs, 0))]
            return StepResult(_fetch_all(fetch_tokens, logprobs, prompt_logprobs), marks, F)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits ``[len(batch.logits_indices), vocab]`` float32 for this batch, on every rank
        (the accuracy tool and the tests; the engine uses ``execute``)."""
        self._check(batch)
        self.comm.stats.reset()
        with self.F.no_grad():
            logits = self.model.compute_logits(self._hidden(batch))
        return self.F.to_numpy(self.F.float32(logits))

    def _hidden(self, batch: ForwardBatch):
        """Normed hidden states of the logits rows: a replayed decode graph, or the eager forward."""
        F, like = self.F, self.model.embed_tokens.weight
        if self.graphs is not None and self.graphs.can_run(batch):
            rows = _run_of(batch.logits_indices)
            if rows is None:  # uploaded before the replay: a plain copy after it would wait for the whole graph
                rows = F.upload(batch.logits_indices, like)
            hidden = self.graphs.run(batch)  # a row per token
            return hidden[rows] if isinstance(rows, slice) else F.index_rows(hidden, rows)
        # F.upload: a plain copy would wait for the step still running on the device (overlap lost)
        ids = F.upload(batch.input_ids, like)
        if (batch.input_ids < 0).any():  # placeholders: the tokens the last step sampled
            token_rows = F.upload(np.repeat(batch.rows, batch.query_lens), like)
            ids = F.where(ids < 0, F.index_rows(self.next_tokens, token_rows), ids)
        return self.model(ids, F.upload(batch.positions, like), batch, self.kv_caches)

    def _check(self, batch: ForwardBatch) -> None:
        # The engine sizes batches from the same settings; a violation is a bug, not a user error.
        a = self.args
        if batch.num_seqs > a.max_num_seqs or batch.num_tokens > a.max_num_batched_tokens:
            raise ValueError(f"batch of {batch.num_seqs} sequences / {batch.num_tokens} tokens exceeds "
                             f"max_num_seqs={a.max_num_seqs} / max_num_batched_tokens={a.max_num_batched_tokens}")
        if batch.num_seqs and (batch.block_tables.min() < 0 or batch.block_tables.max() >= a.num_kv_blocks):
            raise ValueError(f"KV-cache block outside 0..{a.num_kv_blocks - 1} in the block tables")
        ends = batch.context_lens + batch.query_lens
        if batch.num_seqs and ends.max() > a.max_model_len:
            raise ValueError(f"sequence of {int(ends.max())} tokens exceeds max_model_len={a.max_model_len}")

    # ---- what it chose, for logs and reports --------------------------------------------
    def fusion_stats(self) -> dict:
        """Counters of the last forward (see ``glm_fused.fused_op.FusionStats.as_dict``)."""
        return self.comm.stats.as_dict()

    def fusion_impl(self) -> str:
        """The fused op's implementation after start-up: flashinfer, reference, or off."""
        if not self.args.fused:
            return "off"
        return "flashinfer" if self.comm.kernel is not None else "reference"

    def weights(self) -> str:
        """What the weights are: the model dtype, or fp8 (held as such, or dequantized where the
        framework has no fp8 kernels for the device)."""
        model = self.model
        if model.quant is None:
            return self.args.dtype
        if model.fp8_params:
            return model.quant.describe()
        return (f"{model.quant.describe()}, held dequantized in {self.args.dtype} (fp8 kernels: torch, "
                f"bfloat16, a CUDA GPU of sm89 or later)")

    def decode_mode(self) -> str:
        """How decode steps run: replayed CUDA graphs (with their batch sizes) or eager."""
        return f"cuda-graphs {self.graphs.sizes}" if self.graphs is not None else "eager"

    def close(self) -> None:
        self.graphs = None  # before the workspace goes: the graphs point into it
        if self.comm.kernel is not None:
            self.comm.kernel.close()
            self.comm.kernel = None
        self.kv_caches = []
        self.F.empty_cache(self.device)

