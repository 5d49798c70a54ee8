"""ModelRunner: one rank's model, weights, KV cache and fusion kernel; ForwardBatch in, logits out."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed

from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.runner_base import RunnerBase
from glm_fused.torch_backend import dist, kernels
from glm_fused.torch_backend.cuda_graph import DecodeGraphs
from glm_fused.torch_backend.loader import dummy_weights, load_weights
from glm_fused.torch_backend.model import Glm4MoeForCausalLM, torch_dtype

log = logging.getLogger("glm_fused.runner")


class ModelRunner(RunnerBase):
    """Runs on every rank after ``init_distributed``; every rank gets the same full-vocab logits."""

    def __init__(self, config: Glm4MoeConfig, model_dir: str | Path | None, *, tp_rank: int, tp_size: int,
                 dtype: str, fused: bool, fusion: str, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, load_format: str = "safetensors", seed: int = 0,
                 cuda_graph: bool = True):
        self._init_limits(config, tp_size=tp_size, fused=fused, fusion=fusion, load_format=load_format,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens)
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
        # Decode steps replay CUDA graphs on a GPU with the Triton kernels (cuda_graph=False:
        # --enforce-eager); the graphs' padding rows get a scratch KV slot past the engine's.
        use_graphs = cuda_graph and self.device.type == "cuda" and kernels.enabled(self.model.embed_tokens.weight)
        self.kv_caches = self.model.make_kv_caches(max_num_seqs + int(use_graphs), max_model_len)
        self._setup_fusion(str(self.dtype).removeprefix("torch."))
        self.graphs = None
        if use_graphs:  # after _setup_fusion: the fused all-reduce workspace must exist before capture
            self.graphs = self._capture(max_num_seqs)

    def _capture(self, max_num_seqs: int) -> DecodeGraphs | None:
        """The decode graphs, or None (eager decode) when any rank could not capture: a kernel
        that cannot be captured is a slower server, not a dead one."""
        graphs, error = None, None
        try:
            with torch.inference_mode():
                graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, pad_slot=max_num_seqs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager decode
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            torch.cuda.synchronize(self.device)
        ok = error is None
        if self.comm.size > 1:
            ok = self._all_ranks_agree(ok)
        if not ok:
            log.warning("CUDA graphs off, decode runs eagerly: %s",
                        error or "another rank could not capture its decode graphs")
            return None
        return graphs

    # ---- what RunnerBase asks of a backend ------------------------------------------------
    def _gpu_sm(self) -> int | None:
        if self.device.type != "cuda":
            return None
        major, minor = torch.cuda.get_device_capability(self.device)
        return major * 10 + minor

    def _all_ranks_agree(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32,
                            device=self.device if dist.dist_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(int(flag.item()))

    def _shares_gpu(self) -> bool:
        return dist.shares_gpu()

    def _kernel_tensor_args(self):
        return self.dtype, self.device

    # ---- one step ------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits ``[len(batch.logits_indices), vocab]`` float32 for this batch, on every rank."""
        self._check(batch)
        self.comm.stats.reset()
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.can_run(batch):
                hidden = self.graphs.run(batch)
                if not np.array_equal(batch.logits_indices, np.arange(batch.num_seqs)):
                    hidden = hidden[torch.as_tensor(batch.logits_indices, device=self.device)]
            else:
                input_ids = torch.from_numpy(batch.input_ids).to(self.device)
                positions = torch.from_numpy(batch.positions).to(self.device)
                hidden = self.model(input_ids, positions, batch, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return logits.float().cpu().numpy()

    def close(self) -> None:
        self.graphs = None  # before the workspace goes: the graphs point into it
        super().close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
