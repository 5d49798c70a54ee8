"""FlashInfer adapter: TRT-LLM's fused all-reduce + residual-add + RMSNorm kernel, in torch.

The one piece of kernel-calling code both backends use: torch tensors in, torch tensors out.
Paddle reaches it through DLPack (``as_torch``), zero-copy, and wraps the results back the
same way. ``import glm_fused`` never imports this module, and this module imports flashinfer
only when asked (``probe()`` or the constructor): that import takes seconds and loads CUDA
bindings.

Everything FlashInfer takes is passed by keyword: positional orders changed between releases.
Written against flashinfer-python 0.7.2.post1; ``probe()`` checks the keywords this file uses
against the installed signatures, so a release that renames one is refused, not miscalled.

Use: one instance per process, made at model start-up (never on the first forward: lazy
creation breaks CUDA-graph capture), shared by every fused call of every layer. The caller
decides per call with ``glm_fused.fused_op.policy.choose_impl`` and must make all TP ranks agree that
the workspace exists (a vote after construction) before any rank calls the kernel.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import warnings
import weakref
from ctypes import c_void_p
from types import SimpleNamespace

import torch

from glm_fused.fused_op import policy

# Keywords this file passes; probe() checks them against the installed FlashInfer.
CALL_KEYWORDS = (
    "allreduce_in", "world_size", "world_rank", "token_num", "hidden_dim", "workspace_ptrs",
    "launch_with_pdl", "trigger_completion_at_end", "fp32_acc", "pattern_code", "use_oneshot",
    "allreduce_out", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out",
    "rms_gamma", "rms_eps", "scale_factor", "layout_code",
)
WORKSPACE_KEYWORDS = (
    "tp_rank", "tp_size", "max_token_num", "hidden_dim", "use_fp32_lamport", "group",
    "create_metadata", "comm_backend", "use_symm_dev_mem",
)
# AllReduceFusionPattern.kARResidualRMSNorm: residual_out = allreduce(in) + residual_in,
# norm_out = rmsnorm(residual_out) * gamma. The constructor reads it from FlashInfer; this
# copy serves prepare_call() where FlashInfer is not installed (CPU tests).
PATTERN_AR_RESIDUAL_RMSNORM = 1

_TORCH_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_COMM_BACKEND_METHODS = ("Get_rank", "Get_size", "allgather", "bcast", "barrier", "Split")


class FusionUnavailable(Exception):
    """The kernel cannot serve this process (or this call); the caller takes the reference."""


class FusionArgumentError(FusionUnavailable):
    """A call the kernel must not see (dtype, shape, size, device); raised before any launch,
    so a wrong call fails loudly instead of corrupting output or memory."""


def as_torch(x) -> torch.Tensor:
    """A torch view of ``x``: a torch tensor as is, anything DLPack-capable (a Paddle tensor,
    a NumPy array, a DLPack capsule) zero-copy on the same memory."""
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.utils.dlpack.from_dlpack(x)
    except Exception as exc:
        raise TypeError(f"as_torch: {type(x).__name__} is neither a torch tensor nor DLPack-capable "
                        f"({exc})") from exc


def _short(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.cache
def _flashinfer():
    """FlashInfer's pieces this file uses, imported once (raises what the import raises)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.comm as comm
        from flashinfer.comm.cuda_ipc import cudart
        from flashinfer.comm.mnnvl import TorchDistBackend
    return SimpleNamespace(
        version=getattr(__import__("flashinfer"), "__version__", "unknown"),
        allreduce_fusion=comm.trtllm_allreduce_fusion,
        create_workspace=comm.trtllm_create_ipc_workspace_for_all_reduce_fusion,
        destroy_workspace=comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion,
        pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm,
        TorchDistBackend=TorchDistBackend,
        cudart=cudart,
    )


def _missing_keywords(fn, names) -> list[str]:
    params = inspect.signature(fn).parameters  # follows __wrapped__ through @deprecated
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [n for n in names if n not in params]


def probe() -> str | None:
    """None when the kernel can be set up here; else a short reason for the fallback log."""
    if not torch.cuda.is_available():
        return "CUDA not available"
    try:
        fi = _flashinfer()
    except Exception as exc:
        return f"flashinfer.comm not importable ({_short(exc)})"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10, 12):
        return f"no TRT-LLM all-reduce kernels for sm{major}{minor} (SM90/SM100/SM120 only)"
    missing = (_missing_keywords(fi.allreduce_fusion, CALL_KEYWORDS)
               + _missing_keywords(fi.create_workspace, WORKSPACE_KEYWORDS))
    if missing:
        return f"flashinfer {fi.version} lacks keywords this adapter passes: {', '.join(missing)}"
    return None


def device_sm(device=None) -> int | None:
    """Compute capability as an int (90 for H100/H200), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def kernel_env(*, tp_size: int, hidden_size: int, workspace_max_tokens: int,
               flashinfer_error: str | None = None, device=None) -> policy.KernelEnv:
    """The ``KernelEnv`` of this process's real device (CPU when CUDA is absent)."""
    on_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    return policy.KernelEnv(device="cuda" if on_cuda else "cpu",
                            sm=device_sm(device) if on_cuda else None, tp_size=tp_size,
                            hidden_size=hidden_size, flashinfer_error=flashinfer_error,
                            workspace_max_tokens=workspace_max_tokens)


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, policy.normalize_dtype(dtype), None)
    if not isinstance(value, torch.dtype):
        raise FusionUnavailable(f"unknown dtype {dtype!r}")
    return value


def _is_comm_backend(obj) -> bool:
    return obj is not None and all(callable(getattr(obj, m, None)) for m in _COMM_BACKEND_METHODS)


def prepare_call(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 tp_rank: int, tp_size: int, max_num_tokens: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, workspace_ptrs, launch_with_pdl: bool,
                 sm: int | None = None, norm_out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, use_oneshot: bool | None = None,
                 pattern_code=PATTERN_AR_RESIDUAL_RMSNORM) -> dict:
    """Check one call and build the keywords of ``trtllm_allreduce_fusion``.

    Raises ``FusionArgumentError`` for anything the kernel would silently get wrong: a dtype
    other than the workspace's (an fp32 gamma with bf16 activations corrupted output for
    others), a shape that is not ``[tokens, hidden]``, more tokens than the workspace (illegal
    memory access), two-shot with ``tokens <= tp``, tensors on another device. Outputs are
    fresh unless the caller passes buffers; ``residual_out=residual`` updates in place.
    """
    if partial.dim() != 2:
        raise FusionArgumentError(f"partial must be [tokens, hidden], got shape {tuple(partial.shape)}")
    num_tokens, hidden = partial.shape
    if hidden != hidden_size:
        raise FusionArgumentError(f"hidden {hidden} != workspace hidden {hidden_size}")
    if num_tokens == 0:
        raise FusionArgumentError("no tokens")
    if num_tokens > max_num_tokens:
        raise FusionArgumentError(f"{num_tokens} tokens > workspace {max_num_tokens}")
    if residual.shape != partial.shape:
        raise FusionArgumentError(f"residual shape {tuple(residual.shape)} != partial {tuple(partial.shape)}")
    if weight.shape != (hidden,):
        raise FusionArgumentError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    for name, t in (("partial", partial), ("residual", residual), ("weight", weight)):
        if t.dtype != dtype:
            raise FusionArgumentError(f"{name} dtype {t.dtype} != workspace dtype {dtype} "
                                      "(cast the norm weight once at load time)")
        if t.device != device:
            raise FusionArgumentError(f"{name} on {t.device}, workspace on {device}")
    partial = partial.contiguous()
    residual = residual.contiguous()
    weight = weight.contiguous()
    outs = {}
    for name, buf in (("norm_out", norm_out), ("residual_out", residual_out)):
        if buf is None:
            buf = torch.empty_like(partial)
        elif buf.shape != partial.shape or buf.dtype != dtype or buf.device != device \
                or not buf.is_contiguous():
            raise FusionArgumentError(f"{name} must be a contiguous {dtype} [{num_tokens}, {hidden}] "
                                      f"tensor on {device}")
        outs[name] = buf
    if use_oneshot is None:
        use_oneshot = policy.use_oneshot(tp_size, num_tokens, hidden, partial.element_size(), sm=sm)
    elif not use_oneshot and num_tokens <= tp_size:
        raise FusionArgumentError(f"two-shot needs tokens > tp_size ({num_tokens} <= {tp_size})")
    return dict(
        allreduce_in=partial, world_size=tp_size, world_rank=tp_rank, token_num=num_tokens,
        hidden_dim=hidden, workspace_ptrs=workspace_ptrs, launch_with_pdl=launch_with_pdl,
        # True always: with False the one-shot kernel signals completion before its output is
        # written, and a PDL-launched successor read garbage (NaN seen by others).
        trigger_completion_at_end=True,
        fp32_acc=True, pattern_code=pattern_code, use_oneshot=bool(use_oneshot),
        allreduce_out=None, residual_in=residual, residual_out=outs["residual_out"],
        norm_out=outs["norm_out"], quant_out=None, scale_out=None, rms_gamma=weight,
        rms_eps=float(eps), scale_factor=None, layout_code=None,
    )


# Instances still holding a workspace, released at interpreter exit.
_LIVE: "weakref.WeakSet[FlashInferAllReduceFusion]" = weakref.WeakSet()


class FlashInferAllReduceFusion:
    """One process's workspace for the fused kernel, and the call that uses it.

    ``group``: the TP group's ``torch.distributed`` process group, or any object with
    FlashInfer's comm-backend protocol (``Get_rank, Get_size, allgather, bcast, barrier,
    Split``), which is how a Paddle process group drives the exchange. The exchange must run
    on the TP group: one of another size is refused.

    The workspace is always FlashInfer's symmetric device memory (``use_symm_dev_mem=True``,
    ``create_metadata=True``, handles swapped through the comm backend): it is the only kind
    that works when TP ranks share one GPU (``shared_gpu=True``; torch's symmetric memory
    refuses overlapping devices), the only one a non-torch group can drive, it never creates
    NVLink multicast objects, and FlashInfer's own unified API picks it by default.
    ``shared_gpu`` is recorded for reports; the workspace path is the same either way.

    Creating it is collective: every TP rank must construct at the same point. It raises
    ``FusionUnavailable`` on any failure; the caller then falls back (after all ranks agree).
    """

    def __init__(self, *, tp_rank: int, tp_size: int, max_num_tokens: int, hidden_size: int,
                 dtype, device, group, shared_gpu: bool = False):
        self._closed = True  # until the workspace exists
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.max_num_tokens, self.hidden_size = int(max_num_tokens), int(hidden_size)
        self.dtype = _torch_dtype(dtype)
        self.shared_gpu = bool(shared_gpu)
        problem = self._argument_problem()
        if problem:
            raise FusionUnavailable(problem)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise FusionUnavailable(f"device {self.device} is not CUDA")
        reason = probe()
        if reason:
            raise FusionUnavailable(reason)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)  # FlashInfer allocates on the current device
        fi = _flashinfer()
        self._fi = fi
        self.sm = device_sm(self.device)
        self.launch_with_pdl = self.sm >= 90  # programmatic dependent launch exists from Hopper on
        torch_group = None if _is_comm_backend(group) else group
        try:
            comm = group if torch_group is None else fi.TorchDistBackend(group=torch_group)
            sizes = (comm.Get_size(), comm.Get_rank())
        except Exception as exc:
            raise FusionUnavailable(f"no process group for the workspace exchange ({_short(exc)})") from exc
        if sizes != (self.tp_size, self.tp_rank):
            raise FusionUnavailable(f"exchange group is rank {sizes[1]} of {sizes[0]}, but this is TP "
                                    f"rank {self.tp_rank} of {self.tp_size}: pass the TP group")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                created = fi.create_workspace(
                    tp_rank=self.tp_rank, tp_size=self.tp_size, max_token_num=self.max_num_tokens,
                    hidden_dim=self.hidden_size, use_fp32_lamport=False, group=torch_group,
                    create_metadata=True, comm_backend=comm, use_symm_dev_mem=True)
            self._ipc_handles, self._workspace, self._mem_handles, self._metadata = created
        except Exception as exc:
            raise FusionUnavailable(f"workspace creation failed ({_short(exc)})") from exc
        # The @deprecated wrapper warns on every call; the function under it is the same.
        self._kernel = getattr(fi.allreduce_fusion, "__wrapped__", fi.allreduce_fusion)
        self._pattern = fi.pattern
        self._closed = False
        _LIVE.add(self)

    def _argument_problem(self) -> str | None:
        if self.tp_size not in policy.KERNEL_TP_SIZES:
            return f"tp_size {self.tp_size} not in {policy.KERNEL_TP_SIZES}"
        if not 0 <= self.tp_rank < self.tp_size:
            return f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}"
        if self.max_num_tokens <= 0:
            return "max_num_tokens must be > 0"
        if self.hidden_size <= 0 or self.hidden_size % policy.VECTOR_ELEMENTS:
            return f"hidden_size {self.hidden_size} not a positive multiple of {policy.VECTOR_ELEMENTS}"
        if self.dtype not in _TORCH_KERNEL_DTYPES:
            return f"dtype {self.dtype} is not bf16/fp16"
        return None

    @property
    def workspace_bytes(self) -> int:
        return policy.workspace_bytes(self.tp_size, self.max_num_tokens, self.hidden_size)

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 *, norm_out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                 use_oneshot: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(allreduce(partial) + residual) * weight, allreduce(partial) + residual)``.

        Collective: every TP rank calls with the same token count. ``partial`` is not modified.
        ``use_oneshot`` forces the algorithm (checks only); None uses ``policy.use_oneshot``.
        """
        if self._closed:
            raise FusionUnavailable("workspace closed")
        kwargs = prepare_call(
            partial, residual, weight, eps, tp_rank=self.tp_rank, tp_size=self.tp_size,
            max_num_tokens=self.max_num_tokens, hidden_size=self.hidden_size, dtype=self.dtype,
            device=self.device, workspace_ptrs=self._workspace, launch_with_pdl=self.launch_with_pdl,
            sm=self.sm, norm_out=norm_out, residual_out=residual_out, use_oneshot=use_oneshot,
            pattern_code=self._pattern)
        self._kernel(**kwargs)
        return kwargs["norm_out"], kwargs["residual_out"]

    def close(self) -> None:
        """Free the workspace (this rank's share; peers free theirs). Idempotent."""
        if self._closed:
            return
        try:
            torch.cuda.synchronize(self.device)  # kernels in flight still read the workspace
        except Exception:
            pass
        self._release(free_flags=True)

    def _release(self, free_flags: bool) -> None:
        self._closed = True
        _LIVE.discard(self)
        fi, handles, metadata = self._fi, self._ipc_handles, self._metadata
        self._ipc_handles = self._workspace = self._mem_handles = None
        try:
            fi.destroy_workspace(handles)  # drops FlashInfer's references; memory goes with ours
        except Exception:
            pass
        ptr = (metadata or {}).get("control_flag_ptr")
        if free_flags and ptr:
            try:
                fi.cudart.cudaFree(c_void_p(ptr))
            except Exception:
                pass

    def __enter__(self) -> "FlashInferAllReduceFusion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.workspace_bytes / 2**20:.0f} MiB workspace"
        return (f"FlashInferAllReduceFusion(tp {self.tp_rank}/{self.tp_size}, {self.max_num_tokens} tokens x "
                f"{self.hidden_size}, {self.dtype}, {state})")


@atexit.register
def _release_all_at_exit() -> None:
    # No synchronize here: a peer that died mid-kernel would make it wait forever. Dropping the
    # references lets FlashInfer unmap before interpreter teardown, where its destructors skip.
    for inst in list(_LIVE):
        try:
            inst._release(free_flags=False)
        except Exception:
            pass


__all__ = ["probe", "as_torch", "FusionUnavailable", "FusionArgumentError", "FlashInferAllReduceFusion",
           "prepare_call", "kernel_env", "device_sm", "CALL_KEYWORDS", "WORKSPACE_KEYWORDS"]
