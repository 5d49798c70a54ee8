"""The model's numerics against independent fp64 computations: router precision, RMSNorm
statistics, and the fused all-reduce + residual-add + RMSNorm op (its reference and its kernel path).

What is checked here does not show reliably at the model level: a whole model's bf16 rounding
noise hides the router or the norm statistics computed in bf16 (measured on tests/test_model.py's
checkpoints: they moved the mean bf16-vs-fp32 error by -0.5%..-2% and by +10%..+11%, well inside
the spread between checkpoints). So the layers are driven one by one, through each framework's
layer classes and ops (``get_backend(name).LAYERS`` / ``.OPS``) and ``glm_fused.fused_op``.

Paddle has no bf16 arithmetic on CPU, so its layers are checked in fp32 here; bf16 runs in the
torch backend. Tolerances are stated beside each check.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glm_fused.backends import get_backend  # noqa: E402
from glm_fused.comm import TPCommBase  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.fused_op import KernelEnv, fused_allreduce_residual_rmsnorm  # noqa: E402

BACKENDS = ["torch", pytest.param("paddle", marks=pytest.mark.skipif(
    importlib.util.find_spec("paddle") is None, reason="paddlepaddle is not installed"))]
# bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-9 of itself.
BF16_ULP = 2.0 ** -8  # spacing of bf16 values in [1, 2)


def _to_numpy(x) -> np.ndarray:
    """float64 copy of a torch or Paddle tensor (bf16 included: widened exactly)."""
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    from glm_fused.fused_op.flashinfer import as_torch

    return as_torch(x).double().numpy()


def _from_torch(backend: str, t: torch.Tensor):
    """The same values as a tensor of ``backend`` (Paddle: by DLPack, dtype kept)."""
    if backend == "torch":
        return t
    import paddle

    return paddle.utils.dlpack.from_dlpack(t.contiguous().clone())


def _set(backend: str, param, values: torch.Tensor) -> None:
    """Fill a parameter with ``values`` (cast to its dtype), as the loader does."""
    ops = get_backend(backend).OPS
    ops.assign(param, ops.tensor(values.double().numpy().astype(np.float32), like=param))


# ---- the router: fp32 logits whatever the model dtype --------------------------------------

ROUTER = dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
              norm_topk_prob=True, routed_scaling_factor=2.5)


def _route_fp64(x, w, bias, c: Glm4MoeConfig):
    """GLM-4.5's router (transformers' Glm4MoeTopkRouter + route_tokens_to_experts) in float64."""
    scores = 1.0 / (1.0 + np.exp(-(x @ w.T)))
    choice = scores + bias
    T, E = choice.shape
    groups = np.sort(choice.reshape(T, c.n_group, -1), axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-groups, axis=-1, kind="stable")[:, :c.topk_group]
    mask = np.zeros_like(groups, dtype=bool)
    np.put_along_axis(mask, keep, True, axis=1)
    choice = np.where(np.repeat(mask, E // c.n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :c.num_experts_per_tok]
    weights = np.take_along_axis(scores, ids, axis=1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_matches_fp64_and_keeps_fp32_logits_under_bf16(backend):
    """The router's logits (``TopKRouter``) and its choice (``Ops.route``: sigmoid, grouped
    top-k, renormalised, scaled by routed_scaling_factor 2.5) against fp64, for bf16 activations
    (torch) or fp32 (Paddle): weights within 1e-5 and the same experts chosen. The logits must be
    fp32: computed in bf16 they carry 2**-9 relative rounding, which moves the sigmoid weights by
    ~1e-3 and flips close choices."""
    c = Glm4MoeConfig(**ROUTER)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if backend == "torch" else torch.float32
    x = torch.randn(256, c.hidden_size, generator=g).to(dtype)
    w = torch.randn(c.n_routed_experts, c.hidden_size, generator=g) * (2.4 / c.hidden_size ** 0.5)
    bias = 0.1 * torch.rand(c.n_routed_experts, generator=g)
    fw = get_backend(backend)
    router = fw.LAYERS.TopKRouter(c)
    _set(backend, router.weight, w)
    _set(backend, router.e_score_correction_bias, bias)
    logits = router(_from_torch(backend, x))
    assert str(logits.dtype).endswith("float32")
    weights, ids = fw.OPS.route(logits, router.e_score_correction_bias, router.routing)
    ref_w, ref_ids = _route_fp64(_to_numpy(x), w.double().numpy(), bias.double().numpy(), c)
    got_w, got_ids = _to_numpy(weights), _to_numpy(ids).astype(np.int64)
    order = np.argsort(got_ids, axis=1)
    ref_order = np.argsort(ref_ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got_ids, order, 1), np.take_along_axis(ref_ids, ref_order, 1))
    err = np.abs(np.take_along_axis(got_w, order, 1) - np.take_along_axis(ref_w, ref_order, 1)).max()
    # fp32 logits: ~1e-7 (measured 1.7e-7 with the scaling factor 2.5); bf16 logits: ~1e-3.
    assert err <= 1e-5, f"router weights {err:.2e} from fp64"
    assert str(weights.dtype).endswith("float32")


# ---- RMSNorm: fp32 statistics, one rounding before the weight ------------------------------

def _bf16(a: np.ndarray) -> np.ndarray:
    """Round float64 values to bf16 (nearest even), back as float64."""
    return torch.from_numpy(a).float().to(torch.bfloat16).double().numpy()


def test_rmsnorm_statistics_are_fp32_under_bf16():
    """RMSNorm (torch) on bf16 activations against fp64: ``bf16(x * rsqrt(mean(x^2) + eps)) * w``.

    The weights are powers of two, so the weight multiply is exact and the only rounding is
    the cast before it: with fp32 statistics the output is the correctly rounded fp64 value
    except where fp32's own error (~2**-22) straddles a bf16 rounding boundary (~2**-14 of
    elements; measured 0 of 32768). Statistics in bf16 round the mean and the rsqrt to 8 bits:
    a fraction of elements then lands one bf16 step off (measured 29%). Bound: at most 0.5%
    of elements off, and none by more than one bf16 step.
    """
    g = torch.Generator().manual_seed(1)
    H = 128
    # magnitudes over several octaves, so the statistics depend on every element
    x = (torch.randn(256, H, generator=g) * torch.exp(torch.randn(256, H, generator=g))).to(torch.bfloat16)
    w = 2.0 ** torch.randint(-1, 3, (H,), generator=g).float()
    norm = get_backend("torch").LAYERS.RMSNorm(H, 1e-5, "bfloat16")
    _set("torch", norm.weight, w)
    normed, passed = norm(x)
    assert passed is x and normed.dtype == torch.bfloat16
    x64 = x.double().numpy()
    want = _bf16(x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)) * w.double().numpy()
    got = normed.double().numpy()
    step = np.abs(want) * BF16_ULP
    off = np.abs(got - want) > 0
    assert (np.abs(got - want) <= step + 1e-30).all(), "an element more than one bf16 step off"
    assert off.mean() <= 0.005, f"{off.mean():.1%} of elements off by a bf16 step"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rmsnorm_fp32_matches_fp64(backend):
    """fp32 RMSNorm (gamma and eps included) within 1e-6 of fp64 (fp32 rounding, measured <= 9e-8)."""
    g = torch.Generator().manual_seed(2)
    H = 96
    x = torch.randn(9, H, generator=g) * 0.05  # small: eps (1e-2 here) matters
    w = 1.0 + 0.3 * torch.randn(H, generator=g)
    eps = 1e-2
    norm = get_backend(backend).LAYERS.RMSNorm(H, eps)
    _set(backend, norm.weight, w)
    normed, _ = norm(_from_torch(backend, x))
    x64, w64 = x.double().numpy(), w.double().numpy()
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w64
    err = np.abs(_to_numpy(normed) - want).max() / np.abs(want).max()
    assert err <= 1e-6, f"{err:.2e}"


# ---- the fused op: all-reduce, then residual add, then RMSNorm -------------------------------

class SimulatedTP(TPCommBase):
    """One rank's TP handle for the fused op, its all-reduce a ``fake_flashinfer.TwoPassAllReduce``
    (fp32 sum, rounded once to the input dtype); ``kernel`` (a FlashInfer adapter or None) and
    ``kernel_env`` decide each call's path, as start-up sets them."""

    def __init__(self, backend: str, all_reduce, rank: int, kernel=None, workspace_tokens: int = 0,
                 hidden: int = 64):
        super().__init__(rank, all_reduce.size)
        self.backend, self._all_reduce = backend, all_reduce
        self.kernel = kernel
        self.kernel_env = KernelEnv(device="cuda" if kernel else "cpu", sm=90 if kernel else None,
                                    tp_size=self.size, hidden_size=hidden, flashinfer_error=None,
                                    workspace_max_tokens=workspace_tokens)

    def all_reduce_uncounted(self, x):
        total = self._all_reduce(self.rank, torch.from_numpy(_to_numpy(x)))
        dtype = torch.bfloat16 if str(x.dtype).endswith("bfloat16") else torch.float32
        return _from_torch(self.backend, total.to(dtype))


def _fused_fp64(parts: list[np.ndarray], residual: np.ndarray | None, w: np.ndarray, eps: float):
    summed = np.sum(parts, axis=0) + (0.0 if residual is None else residual)
    return summed / np.sqrt((summed ** 2).mean(-1, keepdims=True) + eps) * w, summed


FUSED_CASES = [
    # backend, path, dtype; Paddle computes nothing in bf16 on CPU, but its kernel path only
    # moves bf16 tensors (by DLPack) to the torch kernel and back.
    ("torch", "reference", "float32"), ("torch", "reference", "bfloat16"),
    ("torch", "kernel", "bfloat16"),
    pytest.param("paddle", "reference", "float32", marks=BACKENDS[1].marks),
    pytest.param("paddle", "kernel", "bfloat16", marks=BACKENDS[1].marks),
]
# max |diff| / max |fp64|. fp32: summation order only (measured <= 1.6e-7). bf16: the kernel
# rounds three times (all-reduce sum, residual, normed output) and the reference four (sum,
# add, cast before the weight, weight multiply), each by at most 2**-9 of its value: 2**-7
# (7.8e-3) of the largest value, plus slack where the partial sums are larger than their total
# (measured 5.8e-3 on either path). A wrong order (norm before the add, the residual added on
# every rank, outputs swapped) or a dropped term (gamma, residual) is off by 10% or more.
FUSED_TOL = {"float32": 1e-6, "bfloat16": 1e-2}


@pytest.mark.parametrize("backend, path, dtype", FUSED_CASES)
def test_fused_allreduce_residual_rmsnorm_matches_fp64(backend, path, dtype, monkeypatch):
    """The fused op on every rank of a simulated TP 4 group, against fp64 computed from the same
    rounded inputs: ``(rmsnorm(sum of every rank's partial + residual) * gamma, that sum)``, the
    same on every rank. Ranks run one after another, twice (``TwoPassAllReduce``).

    ``reference``: the op's own all-reduce, add, RMSNorm. ``kernel``: the op picks FlashInfer
    (policy told a sm90 GPU with a workspace), the real adapter checks and maps the call, and
    ``fake_flashinfer.TrtllmStandIn`` does the kernel's arithmetic in the kernel's order and
    precision (bf16 in, fp32 accumulation). Also with no residual (the first layer's call).
    """
    from fake_flashinfer import TrtllmStandIn, TwoPassAllReduce, cpu_adapter

    H, tp = 64, 4
    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    F = get_backend(backend).OPS
    errors = {}
    for tokens, with_residual in ((5, True), (1, True), (17, False)):
        parts = [torch.randn(tokens, H, generator=g).to(tdtype) for _ in range(tp)]
        residual = (2.0 * torch.randn(tokens, H, generator=g)).to(tdtype) if with_residual else None
        w = (1.0 + 0.3 * torch.randn(H, generator=g)).to(tdtype)
        all_reduce = TwoPassAllReduce(tp)
        comms = []
        for rank in range(tp):
            kernel = None
            if path == "kernel":
                kernel = cpu_adapter(monkeypatch, TrtllmStandIn(all_reduce), tp_rank=rank, tp_size=tp,
                                     max_num_tokens=32, hidden_size=H)
            comms.append(SimulatedTP(backend, all_reduce, rank, kernel=kernel,
                                     workspace_tokens=32 if kernel else 0, hidden=H))

        def run(rank):
            inputs = [None if t is None else _from_torch(backend, t.clone()) for t in (parts[rank], residual, w)]
            return fused_allreduce_residual_rmsnorm(*inputs, 1e-5, comms[rank], F)

        for rank in range(tp):
            run(rank)
        all_reduce.replay = True
        outs = [[_to_numpy(t) for t in run(rank)] for rank in range(tp)]
        impl = "flashinfer" if path == "kernel" else "reference"
        assert all(c.stats.impl[impl] == 2 for c in comms), [c.stats.as_dict() for c in comms]
        for rank in range(1, tp):  # replicated: every rank holds the same normed and residual
            for a, b in zip(outs[rank], outs[0]):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} differs from rank 0")
        want_norm, want_sum = _fused_fp64([p.double().numpy() for p in parts],
                                          None if residual is None else residual.double().numpy(),
                                          w.double().numpy(), 1e-5)
        for name, got, want in (("normed", outs[0][0], want_norm), ("residual", outs[0][1], want_sum)):
            errors[f"{name}, {tokens} tokens"] = float(np.abs(got - want).max() / np.abs(want).max())
    assert max(errors.values()) <= FUSED_TOL[dtype], f"from fp64 (bound {FUSED_TOL[dtype]:.1e}): {errors}"
