"""ModelRunner: one rank's model, weights, KV cache and fusion kernel; ForwardBatch in, logits out."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed

from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused import fusion
from glm_fused.torch_backend import dist
from glm_fused.torch_backend.loader import dummy_weights, load_weights
from glm_fused.torch_backend.model import Glm4MoeForCausalLM, torch_dtype

logger = logging.getLogger("glm_fused.torch_backend")

FUSION_CHOICES = ("auto", "reference", "flashinfer")
LOAD_FORMATS = ("safetensors", "dummy")


class ModelRunner:
    """Runs on every rank after ``init_distributed``; every rank gets the same full-vocab logits."""

    def __init__(self, config: Glm4MoeConfig, model_dir: str | Path | None, *, tp_rank: int, tp_size: int,
                 dtype: str, fused: bool, fusion: str, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, load_format: str = "safetensors", seed: int = 0):
        if fusion not in FUSION_CHOICES:
            raise UserError(f"--fusion {fusion!r}: choose one of {', '.join(FUSION_CHOICES)}")
        if load_format not in LOAD_FORMATS:
            raise UserError(f"--load-format {load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
        if max_model_len > config.max_position_embeddings:
            raise UserError(f"--max-model-len {max_model_len}: exceeds the model's max_position_embeddings="
                            f"{config.max_position_embeddings}")
        config.check_tp(tp_size)
        self.config, self.fused, self.fusion = config, fused, fusion
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.dtype = torch_dtype(dtype)
        self.device = dist.device()
        self.comm = dist.TPComm(tp_rank, tp_size)

        with torch.device(self.device):
            self.model = Glm4MoeForCausalLM(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused,
                                            comm=self.comm, dtype=self.dtype, max_position=max_model_len)
        if load_format == "dummy":
            dummy_weights(self.model, seed)
        else:
            load_weights(self.model, model_dir, config, self.model.shard, progress=tp_rank == 0)
        self.model.eval()
        self.kv_caches = self.model.make_kv_caches(max_num_seqs, max_model_len)
        self._setup_fusion()

    # ---- the fused all-reduce + norm kernel, made once at start-up ----------------------
    def _setup_fusion(self) -> None:
        """Workspace now (never on the first forward: that breaks CUDA-graph capture).

        Made only where some call could use it: fused layout, CUDA, ``--fusion`` not
        reference, a kernel TP size and dtype, and a size cap above zero; sized to the smaller
        of max_num_batched_tokens and that cap. Elsewhere ``choose_impl`` names the reason.
        """
        if not self.fused:
            return  # the classic layout makes no fused calls
        comm, kernel, error = self.comm, None, None
        on_gpu = self.device.type == "cuda"
        sm = None
        if on_gpu:
            major, minor = torch.cuda.get_device_capability(self.device)
            sm = major * 10 + minor
        dtype_name = str(self.dtype).removeprefix("torch.")
        tokens = fusion.workspace_tokens(sm, comm.size, self.config.hidden_size,
                                         fusion.DTYPE_BYTES[dtype_name], self.max_num_batched_tokens)
        wanted = (on_gpu and self.fusion != "reference" and comm.size in fusion.KERNEL_TP_SIZES
                  and dtype_name in fusion.KERNEL_DTYPES and tokens > 0)
        if self.fusion == "reference":
            error = "disabled by --fusion reference"
        if wanted:
            kernel, error = self._make_kernel(tokens)
            # Every rank must take the same path, or one waits in the kernel while the others
            # all-reduce: agree that the kernel exists on all ranks before using it anywhere.
            if comm.size > 1:
                ok = torch.tensor([0 if kernel is None else 1], dtype=torch.int32,
                                  device=self.device if dist.dist_backend() == "nccl" else "cpu")
                torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
                if kernel is not None and int(ok.item()) == 0:
                    kernel.close()
                    kernel, error = None, "FlashInfer workspace failed on another rank"
        comm.kernel = kernel
        comm.kernel_env = fusion.KernelEnv(device="gpu" if on_gpu else "cpu", sm=sm, tp_size=comm.size,
                                           hidden_size=self.config.hidden_size, flashinfer_error=error,
                                           workspace_max_tokens=tokens if kernel is not None else 0)
        if kernel is not None:
            logger.info("fused all-reduce + RMSNorm: %r", kernel)
        elif error and self.fusion == "flashinfer":
            logger.warning("fused all-reduce + RMSNorm: FlashInfer unavailable (%s); every call uses the "
                           "reference", error)

    def _make_kernel(self, max_tokens: int):
        try:
            from glm_fused import flashinfer_adapter
        except ImportError as exc:
            return None, f"flashinfer adapter unavailable: {exc}"
        error = flashinfer_adapter.probe()
        if error:
            return None, error
        try:
            kernel = flashinfer_adapter.FlashInferAllReduceFusion(
                tp_rank=self.comm.rank, tp_size=self.comm.size, max_num_tokens=max_tokens,
                hidden_size=self.config.hidden_size, dtype=self.dtype, device=self.device,
                group=self.comm.flashinfer_comm_backend(), shared_gpu=dist.shares_gpu())
        except flashinfer_adapter.FusionUnavailable as exc:
            return None, str(exc)
        return kernel, None

    # ---- one step ------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits ``[len(batch.logits_indices), vocab]`` float32 for this batch, on every rank."""
        self._check(batch)
        self.comm.stats.reset()
        with torch.inference_mode():
            input_ids = torch.from_numpy(batch.input_ids).to(self.device)
            positions = torch.from_numpy(batch.positions).to(self.device)
            hidden = self.model(input_ids, positions, batch, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return logits.float().cpu().numpy()

    def _check(self, batch: ForwardBatch) -> None:
        # The engine sizes batches from the same limits; a violation is a bug, not a user error.
        if batch.num_seqs > self.max_num_seqs or batch.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"batch of {batch.num_seqs} sequences / {batch.num_tokens} tokens exceeds "
                             f"max_num_seqs={self.max_num_seqs} / max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        if batch.num_seqs and (batch.slots.min() < 0 or batch.slots.max() >= self.max_num_seqs):
            raise ValueError(f"KV-cache slot outside 0..{self.max_num_seqs - 1}: {batch.slots.tolist()}")
        ends = batch.context_lens + batch.query_lens
        if batch.num_seqs and ends.max() > self.max_model_len:
            raise ValueError(f"sequence of {int(ends.max())} tokens exceeds max_model_len={self.max_model_len}")

    def fusion_stats(self) -> dict:
        """Counters of the last forward (see ``glm_fused.fusion.FusionStats.as_dict``)."""
        return self.comm.stats.as_dict()

    def close(self) -> None:
        if self.comm.kernel is not None:
            self.comm.kernel.close()
            self.comm.kernel = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
