"""ModelRunner: one rank's model, weights, KV cache and fusion kernel; ForwardBatch in, logits out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import paddle.distributed

from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.paddle_backend import dist
from glm_fused.paddle_backend.loader import dummy_weights, load_weights
from glm_fused.paddle_backend.model import Glm4MoeForCausalLM, paddle_dtype
from glm_fused.runner_base import RunnerBase


class ModelRunner(RunnerBase):
    """Runs on every rank after ``init_distributed``; every rank gets the same full-vocab logits."""

    def __init__(self, config: Glm4MoeConfig, model_dir: str | Path | None, *, tp_rank: int, tp_size: int,
                 dtype: str, fused: bool, fusion: str, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, load_format: str = "safetensors", seed: int = 0,
                 cuda_graph: bool = False):
        # cuda_graph: accepted for the common interface; this backend runs eagerly (its GPU
        # path is unproven, docs/design.md), so there is nothing to capture.
        self._init_limits(config, tp_size=tp_size, fused=fused, fusion=fusion, load_format=load_format,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens)
        self.device = dist.device()
        paddle.set_device(self.device)
        self.dtype = paddle_dtype(dtype)  # after set_device: bfloat16 is refused on CPU only
        self.comm = dist.TPComm(tp_rank, tp_size)

        self.model = Glm4MoeForCausalLM(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused,
                                        comm=self.comm, dtype=self.dtype, max_position=max_model_len)
        if load_format == "dummy":
            dummy_weights(self.model, seed)
        else:
            load_weights(self.model, model_dir, config, self.model.shard, progress=tp_rank == 0)
        self.model.eval()
        self.kv_caches = self.model.make_kv_caches(max_num_seqs, max_model_len)
        self._setup_fusion(self.dtype)

    # ---- what RunnerBase asks of a backend ------------------------------------------------
    def _gpu_sm(self) -> int | None:
        if self.device == "cpu":
            return None
        major, minor = paddle.device.cuda.get_device_capability()
        return major * 10 + minor

    def _all_ranks_agree(self, ok: bool) -> bool:
        flag = paddle.to_tensor([int(ok)], dtype="int32", place=dist.collective_place())
        paddle.distributed.all_reduce(flag, op=paddle.distributed.ReduceOp.MIN)
        return bool(int(flag.item()))

    def _shares_gpu(self) -> bool:
        return dist.shares_gpu()

    def _kernel_tensor_args(self):
        # UNPROVEN for Paddle (no paddlepaddle-gpu 3.x to try it with): the shared torch adapter
        # builds the workspace on this rank's GPU; the exchange of IPC handles runs over the
        # Paddle process group through the comm_backend protocol; tensors cross by DLPack.
        import torch

        return getattr(torch, self.dtype), torch.device("cuda", int(self.device.split(":")[1]))

    # ---- one step ------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits ``[len(batch.logits_indices), vocab]`` float32 for this batch, on every rank."""
        self._check(batch)
        self.comm.stats.reset()
        with paddle.no_grad():
            input_ids = paddle.to_tensor(batch.input_ids)
            positions = paddle.to_tensor(batch.positions)
            hidden = self.model(input_ids, positions, batch, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return logits.astype("float32").numpy()

    def close(self) -> None:
        super().close()
        if self.device != "cpu":
            paddle.device.cuda.empty_cache()
