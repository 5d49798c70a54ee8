"""ModelRunner: one rank's model, weights, KV cache and fused-op kernel; ForwardBatch in, logits out.

Written once for both frameworks: ``args.backend`` names the framework, whose layer classes
(its ``LAYERS``, ``glm_fused.model.bind``) build the model and whose ops (``F``) do the tensor work.
"""

from __future__ import annotations

import logging

import numpy as np

from glm_fused.backends import get_backend
from glm_fused.batch import ForwardBatch
from glm_fused.comm import device_index, shares_gpu
from glm_fused.config import Glm4MoeConfig
from glm_fused.engine_args import EngineArgs
from glm_fused.fused_op import setup_fusion
from glm_fused.model.loader import dummy_weights, load_weights

log = logging.getLogger("glm_fused.runner")


class StepResult:
    """What ``execute`` hands back at once: call it for the sampled tokens (numpy, rank 0; None
    elsewhere), which waits for them; then ``device_seconds`` is the step's forward and LM head
    as the device ran them (events around them: the bound the engine's step time is held to)."""

    def __init__(self, fetch, marks=None, F=None):
        self._fetch, self._marks, self._F = fetch, marks, F

    def __call__(self):
        return self._fetch()

    @property
    def device_seconds(self) -> float | None:
        return None if self._marks is None else self._F.elapsed(*self._marks)


class ModelRunner:
    """Runs on every rank after ``init_distributed``; every rank gets the same full-vocab logits."""

    def __init__(self, args: EngineArgs, config: Glm4MoeConfig, *, tp_rank: int, tp_size: int):
        if not args.resolved:
            raise ValueError("ModelRunner takes resolved settings: call EngineArgs.resolve() first")
        layers = get_backend(args.backend).LAYERS
        F = self.F = layers.F
        self.args, self.config = args, config
        self.device = F.dist.device()
        with F.device_scope(self.device):
            self.comm = F.dist.TPComm(tp_rank, tp_size)
            self.model = layers.Glm4MoeForCausalLM(config, tp_rank=tp_rank, tp_size=tp_size, fused=args.fused,
                                                   comm=self.comm, dtype=args.dtype, max_position=args.max_model_len,
                                                   quantization=args.quantization)
        if args.load_format == "dummy":
            dummy_weights(self.model, args.seed)
        else:
            load_weights(self.model, args.model_dir, progress=tp_rank == 0)
        self.model.eval()
        # Decode steps replay CUDA graphs where the framework has them (not with --enforce-eager);
        # the graphs' padding rows get a scratch KV slot past the engine's.
        use_graphs = not args.enforce_eager and F.can_capture(self.model)
        self.kv_caches = self.model.make_kv_caches(args.max_num_seqs + int(use_graphs), args.max_model_len)
        setup_fusion(self.comm, fused=args.fused, fusion_impl=args.fusion_impl, sm=F.gpu_sm(self.device),
                     hidden_size=config.hidden_size, dtype=args.dtype,
                     max_num_batched_tokens=args.max_num_batched_tokens, kernel_args=self._kernel_args,
                     shares_gpu=shares_gpu())
        # The token each sequence (KV slot) sampled last, on the device: a later step's input
        # id -1 reads it, so the engine can schedule a step before the last one's tokens reach
        # the host (one row more for the graphs' padding slot).
        like = self.model.embed_tokens.weight
        self.next_tokens = F.zeros([args.max_num_seqs + 1], "int64", like=like)
        self._staging = [F.pinned(args.max_num_seqs, "int64") for _ in range(3)]  # results in flight
        self._step = 0
        # After setup_fusion: the fused all-reduce workspace must exist before capture.
        self.graphs = self._capture() if use_graphs else None

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
                                                  pad_slot=self.args.max_num_seqs, next_tokens=self.next_tokens)
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
    def execute(self, batch: ForwardBatch, sampling=None, *, sample: bool = True):
        """The engine's step: the forward, then (``sample``) one token per logits row.

        The logits reach rank 0 only; rank 0 draws the tokens on its device (``sampling``: the
        rows' ``SamplingBatch``, given on rank 0) and sends them to the other ranks, and every
        rank keeps them in ``next_tokens`` by KV slot, where a later step's placeholder ids
        (-1) read them. Nothing waits for the device: the returned callable gives rank 0 the
        tokens as numpy once they are on the host (None on the other ranks, or without ``sample``).
        """
        self._check(batch)
        F = self.F
        self.comm.stats.reset()
        with F.no_grad():
            like = self.model.embed_tokens.weight
            # Uploaded before the forward is queued: nothing after it may wait for the device.
            row_slots = F.upload(batch.slots[batch.logits_seq], like) if sample else None
            start = F.mark(self.device)
            hidden = self._hidden(batch)
            if not sample:
                return StepResult(lambda: None)
            logits = self.model.compute_logits(hidden, dst=0)
            marks = (start, F.mark(self.device))
            if self.comm.rank == 0:
                tokens = F.sample(logits, sampling)
            else:
                tokens = F.zeros([len(batch.logits_indices)], "int64", like=hidden)
            if self.comm.size > 1:
                tokens = self.comm.broadcast(tokens, src=0)
            self.next_tokens[row_slots] = tokens
            if self.comm.rank != 0:
                return StepResult(lambda: None)
            self._step += 1
            return StepResult(F.to_host_async(tokens, self._staging[self._step % len(self._staging)]), marks, F)

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
        F = self.F
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
            if not np.array_equal(batch.logits_indices, np.arange(batch.num_seqs)):
                hidden = F.index_rows(hidden, F.tensor(batch.logits_indices, like=hidden))
            return hidden
        like = self.model.embed_tokens.weight
        ids = F.tensor(batch.input_ids, like)
        if (batch.input_ids < 0).any():  # placeholders: the tokens the last step sampled
            token_slots = F.tensor(np.repeat(batch.slots, batch.query_lens), like)
            ids = F.where(ids < 0, F.index_rows(self.next_tokens, token_slots), ids)
        return self.model(ids, F.tensor(batch.positions, like), batch, self.kv_caches)

    def _check(self, batch: ForwardBatch) -> None:
        # The engine sizes batches from the same settings; a violation is a bug, not a user error.
        a = self.args
        if batch.num_seqs > a.max_num_seqs or batch.num_tokens > a.max_num_batched_tokens:
            raise ValueError(f"batch of {batch.num_seqs} sequences / {batch.num_tokens} tokens exceeds "
                             f"max_num_seqs={a.max_num_seqs} / max_num_batched_tokens={a.max_num_batched_tokens}")
        if batch.num_seqs and (batch.slots.min() < 0 or batch.slots.max() >= a.max_num_seqs):
            raise ValueError(f"KV-cache slot outside 0..{a.max_num_seqs - 1}: {batch.slots.tolist()}")
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


class LogitsRunner:
    """``execute`` for a runner that only has ``forward(batch) -> logits`` (a host array): the
    placeholders resolved from its own record of what it sampled, and the host sampler. For
    stand-ins of the model (tests, tools) that speak the engine's protocol."""

    def execute(self, batch: ForwardBatch, sampling=None, *, sample: bool = True):
        last = self.__dict__.setdefault("_last_sampled", {})
        if (batch.input_ids < 0).any():
            slots = np.repeat(batch.slots, batch.query_lens)
            ids = np.array([last[int(s)] if t < 0 else t for t, s in zip(batch.input_ids, slots)])
            batch = ForwardBatch(ids, batch.positions, batch.slots, batch.query_lens, batch.context_lens,
                                 batch.logits_indices)
        logits = self.forward(batch)
        if not sample:
            return StepResult(lambda: None)
        tokens = sampling.sample_on_host(logits)
        last.update(zip(batch.slots[batch.logits_seq].tolist(), tokens.tolist()))
        return StepResult(lambda: tokens)
