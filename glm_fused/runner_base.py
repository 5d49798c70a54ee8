"""What both backends' ModelRunners share: argument checks, batch checks, and the decision
to build the FlashInfer workspace at start-up. Framework-free; the backends add tensor code
(building the model, the KV cache, one forward, the all-ranks vote)."""

from __future__ import annotations

import logging

from glm_fused import fusion
from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError

logger = logging.getLogger("glm_fused.runner")

FUSION_CHOICES = ("auto", "reference", "flashinfer")
LOAD_FORMATS = ("safetensors", "dummy")


class RunnerBase:
    """Subclasses set ``self.comm`` (with ``rank``, ``size``, ``stats``, ``kernel``, ``kernel_env``,
    ``flashinfer_comm_backend()``) and implement ``_gpu_sm()``, ``_all_ranks_agree(ok)``,
    ``_shares_gpu()`` and ``_kernel_tensor_args() -> (torch dtype, torch device)``."""

    def _init_limits(self, config: Glm4MoeConfig, *, tp_size: int, fused: bool, fusion: str, load_format: str,
                     max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:
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

    # ---- the fused all-reduce + norm kernel, made once at start-up ----------------------
    def _setup_fusion(self, dtype_name: str) -> None:
        """Workspace now (never on the first forward: that breaks CUDA-graph capture).

        Made only where some call could use it: fused layout, GPU, ``--fusion`` not
        reference, a kernel TP size and dtype, and a size cap above zero; sized to the smaller
        of max_num_batched_tokens and that cap. Elsewhere ``choose_impl`` names the reason.
        """
        if not self.fused:
            return  # the classic layout makes no fused calls
        comm, kernel, error = self.comm, None, None
        sm = self._gpu_sm()
        on_gpu = sm is not None
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
            if comm.size > 1 and not self._all_ranks_agree(kernel is not None) and kernel is not None:
                kernel.close()
                kernel, error = None, "FlashInfer workspace failed on another rank"
        comm.kernel = kernel
        comm.kernel_env = fusion.KernelEnv(device="gpu" if on_gpu else "cpu", sm=sm, tp_size=comm.size,
                                           hidden_size=self.config.hidden_size, flashinfer_error=error,
                                           workspace_max_tokens=tokens if kernel is not None else 0)
        if kernel is not None:
            logger.info("fused all-reduce + RMSNorm: %r", kernel)
        elif self.fusion == "flashinfer":
            # Asked for by name: say why it cannot run, as a warning rather than a fallback note.
            why = error or fusion.choose_impl(comm.kernel_env, dtype=dtype_name, num_tokens=1)[1]
            logger.warning("fused all-reduce + RMSNorm: FlashInfer unavailable (%s); every call uses the "
                           "reference", why)

    def _make_kernel(self, max_tokens: int):
        try:
            from glm_fused import flashinfer_adapter
            dtype, device = self._kernel_tensor_args()
        except ImportError as exc:
            return None, f"flashinfer adapter unavailable: {exc}"
        error = flashinfer_adapter.probe()
        if error:
            return None, error
        try:
            kernel = flashinfer_adapter.FlashInferAllReduceFusion(
                tp_rank=self.comm.rank, tp_size=self.comm.size, max_num_tokens=max_tokens,
                hidden_size=self.config.hidden_size, dtype=dtype, device=device,
                group=self.comm.flashinfer_comm_backend(), shared_gpu=self._shares_gpu())
        except flashinfer_adapter.FusionUnavailable as exc:
            return None, str(exc)
        return kernel, None

    def close(self) -> None:
        if self.comm.kernel is not None:
            self.comm.kernel.close()
            self.comm.kernel = None
        self.kv_caches = []
