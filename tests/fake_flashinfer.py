"""Test-only stand-ins that let FlashInfer's adapter run on a machine without a GPU.

* ``FakeComm``: FlashInfer's comm-backend protocol, as a Paddle group would provide it.
* ``fake_namespace(calls, kernel)``: what ``glm_fused.fused_op.flashinfer._flashinfer()`` returns, with
  ``kernel`` as ``trtllm_allreduce_fusion`` (by default one that only records its keywords).
* ``pretend_gpu(monkeypatch, namespace)``: the adapter's CUDA checks answer "an sm90 GPU".
* ``cpu_adapter(monkeypatch, kernel, ...)``: a real ``FlashInferAllReduceFusion`` made through
  its real constructor, then pointed at the CPU, so its real ``__call__`` (argument checks,
  keyword mapping, what comes back where) drives ``kernel`` here.
* ``TwoPassAllReduce``: an all-reduce over ranks simulated one after another in this process.
* ``TrtllmStandIn``: the kernel's arithmetic for pattern kARResidualRMSNorm in its order and
  precision, over a ``TwoPassAllReduce``, so results can be checked against fp64.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm_fused.fused_op import flashinfer as fa


class FakeComm:
    """FlashInfer's comm-backend protocol over a group of one process pretending to be ``size``."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):  # noqa: N802 - FlashInfer's names
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def allgather(self, data):
        return [data] * self.size

    def bcast(self, data, root):
        return data

    def barrier(self):
        pass

    def Split(self, color, key):  # noqa: N802
        return self


def fake_namespace(calls: dict, kernel=None) -> SimpleNamespace:
    """FlashInfer's pieces the adapter uses; ``calls`` records what each was given."""
    def create_workspace(**kw):
        calls["create"] = kw
        return [[1], [2], [3]], "workspace-tensor", ["mem"], {"control_flag_ptr": 1234}

    def record(**kw):
        calls["call"] = kw

    return SimpleNamespace(
        version="fake", allreduce_fusion=kernel or record, create_workspace=create_workspace,
        destroy_workspace=lambda handles: calls.setdefault("destroyed", handles),
        pattern=fa.PATTERN_AR_RESIDUAL_RMSNORM,
        TorchDistBackend=lambda group: pytest.fail("a comm backend was given"),
        cudart=SimpleNamespace(cudaFree=lambda p: calls.setdefault("freed", p.value)))


def pretend_gpu(monkeypatch, namespace: SimpleNamespace) -> None:
    monkeypatch.setattr(fa, "_flashinfer", lambda: namespace)
    monkeypatch.setattr(fa, "probe", lambda: None)
    monkeypatch.setattr(fa, "device_sm", lambda device=None: 90)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)


def cpu_adapter(monkeypatch, kernel, *, tp_rank: int = 0, tp_size: int = 2, max_num_tokens: int = 64,
                hidden_size: int = 64, dtype=torch.bfloat16, calls: dict | None = None):
    """A FlashInferAllReduceFusion whose kernel is ``kernel``, callable with CPU tensors."""
    pretend_gpu(monkeypatch, fake_namespace({} if calls is None else calls, kernel))
    adapter = fa.FlashInferAllReduceFusion(tp_rank=tp_rank, tp_size=tp_size, max_num_tokens=max_num_tokens,
                                           hidden_size=hidden_size, dtype=dtype, device="cuda:0",
                                           group=FakeComm(tp_rank, tp_size))
    # Construction took the real path on a pretended GPU; the tensors (and the stand-in
    # kernel) live on the CPU, so the workspace's device is the CPU from here on.
    adapter.device = torch.device("cpu")
    return adapter


class TwoPassAllReduce:
    """An all-reduce over ``size`` ranks simulated in one process, for ops that make exactly one
    collective call: run every rank's op once to record what it contributes (``record`` pass,
    the result is a placeholder), then again (``replay = True``) to get the fp32 sum of every
    rank's contribution. Each rank's op thus runs its own code on its own inputs, as it would
    on its own process; a rank contributing something else on the replay is an error."""

    def __init__(self, size: int):
        self.size, self.replay = size, False
        self.inputs: dict[int, torch.Tensor] = {}

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().clone()
        if not self.replay:
            self.inputs[rank] = x
            return x
        assert torch.equal(self.inputs[rank], x), f"rank {rank} contributed other values on the replay"
        total = torch.zeros_like(x)
        for r in range(self.size):
            total += self.inputs[r]
        return total


class TrtllmStandIn:
    """``trtllm_allreduce_fusion`` with pattern kARResidualRMSNorm, on the CPU.

    The kernel's order and precision (TensorRT-LLM's allReduceFusionKernels.cu, which FlashInfer
    ships): every rank's 16-bit input summed in fp32 (``fp32_acc``) and rounded to the input
    dtype; the residual added and rounded (``residual_out``); the sum of squares of that rounded
    residual in fp32, ``rsqrt(mean + eps)``, and ``x * scale * gamma`` in fp32, rounded once
    (``norm_out``). ``all_reduce(rank, x)`` gives the fp32 sum over ranks (``TwoPassAllReduce``).
    Outputs are written in place, like the kernel's.
    """

    def __init__(self, all_reduce):
        self.all_reduce = all_reduce
        self.calls: list[dict] = []

    def __call__(self, **kw) -> None:
        self.calls.append(kw)
        assert kw["pattern_code"] == fa.PATTERN_AR_RESIDUAL_RMSNORM, kw["pattern_code"]
        assert kw["fp32_acc"] is True and kw["world_size"] == self.all_reduce.size
        x = kw["allreduce_in"]
        assert tuple(x.shape) == (kw["token_num"], kw["hidden_dim"])
        summed = self.all_reduce(kw["world_rank"], x).to(x.dtype)
        residual = (summed.float() + kw["residual_in"].float()).to(x.dtype)
        r = residual.float()
        scale = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + kw["rms_eps"])
        normed = (r * scale * kw["rms_gamma"].float()).to(x.dtype)
        kw["residual_out"].copy_(residual)  # after every read: outputs may alias inputs
        kw["norm_out"].copy_(normed)
