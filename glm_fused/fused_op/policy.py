"""When may FlashInfer's fused all-reduce + residual-add + RMSNorm kernel serve a call?

Framework-free on purpose (no torch, no paddle): both backends ask the same questions and
the CPU tests can check every answer. The kernel itself lives in
``glm_fused.fused_op.flashinfer``; this module only decides.

Every TP rank must reach the same decision for the same call, or one rank waits inside the
kernel for peers that took the reference path. The inputs here (token count, dtype, the
``KernelEnv`` the runners agree on at start-up) are identical on all ranks, and nothing here
reads per-rank state.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

# World sizes the TRT-LLM kernel is compiled for (trtllm_allreduce_fusion dispatches on these).
KERNEL_TP_SIZES = (2, 4, 8, 16)

# 16-bit activations only: the workspace here is made for bf16/fp16 (fp32 would need the
# fp32 Lamport workspace, twice the memory, for no use in this model).
KERNEL_DTYPES = ("bfloat16", "float16")

# The kernel moves 16-byte vectors: 8 elements of a 16-bit dtype per access.
VECTOR_ELEMENTS = 8

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Largest input (tokens * hidden * dtype_bytes, bytes) one fused call may take, per compute
# capability and TP size. Above it the unfused all-reduce + norm is at least as fast, so the
# reference path runs. A missing entry means "never fused". To be replaced by measurements
# on this project's own GPUs (one per rank; a shared GPU says nothing about timing).
_SIZE_CAP_BYTES: dict[int, dict[int, int]] = {
    # Hopper (H100/H200): vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB[90]; fusion gains are small on
    # Hopper and only at low token counts, hence the tight TP4/TP8 caps. No TP16 entry there.
    90: {2: 64 * MiB, 4: 2 * MiB, 8: MiB // 2},
    # Blackwell B200: vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB[100] (TP16 is their multi-node entry).
    100: {2: 64 * MiB, 4: 32 * MiB, 8: 1 * MiB, 16: 64 * MiB},
    # Blackwell B300: vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB[103].
    103: {2: 64 * MiB, 4: 64 * MiB, 8: 4 * MiB, 16: 64 * MiB},
    # SM120 (RTX-class Blackwell, PCIe): no published tuning; Hopper's conservative caps until
    # measured, since the kernels are built for it but the links are slower.
    120: {2: 64 * MiB, 4: 2 * MiB, 8: MiB // 2},
}

# One-shot vs two-shot switch, bytes of one rank's input (tokens * hidden * dtype_bytes):
# vLLM's _FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB. Archs without an entry use FlashInfer's own
# C++ default (one-shot up to 128 tokens, kOneShotMaxToken).
_ONESHOT_MAX_BYTES: dict[int, dict[int, int]] = {
    90: {2: 32 * MiB, 4: 2 * MiB, 8: MiB // 2},
    100: {2: 32 * MiB, 4: 4 * MiB, 8: 1 * MiB},
    103: {2: 32 * MiB, 4: 4 * MiB, 8: 2 * MiB},
}
_ONESHOT_DEFAULT_MAX_TOKENS = 128

# FlashInfer's MAX_COMM_SIZE: the Lamport window of one one-shot exchange (tp * input bytes)
# must fit in an int32 count, rounded down to 2 MiB. Past it only two-shot is possible.
_MAX_LAMPORT_COMM_BYTES = 2147483647 & ~((1 << 21) - 1)


def normalize_dtype(dtype) -> str:
    """'bfloat16' for 'bf16', 'torch.bfloat16', 'paddle.bfloat16', torch.bfloat16, ...

    Unknown names come back as given (lower-cased) so the caller's reason names them.
    """
    name = str(dtype).lower()
    for prefix in ("torch.", "paddle.", "numpy.", "np."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return _DTYPE_ALIASES.get(name, name)


def _normalize_device(device: str) -> str:
    # The runners say "gpu" (Paddle's word); CUDA is what they mean.
    d = str(device).lower()
    return "cuda" if d == "gpu" or d.startswith("cuda") or d.startswith("gpu:") else d


@dataclass(frozen=True)
class KernelEnv:
    """What one rank knows at start-up about the kernel; identical on every TP rank."""

    device: str                  # "cpu" | "cuda" ("gpu" is taken as "cuda")
    sm: int | None               # compute capability as an int: 90, 100, 120; None on CPU
    tp_size: int
    hidden_size: int
    flashinfer_error: str | None  # None when flashinfer.comm is usable, else why not
    workspace_max_tokens: int     # 0 when no workspace was created


def size_cap_tokens(sm: int | None, tp_size: int, hidden_size: int, dtype_bytes: int) -> int:
    """Most tokens one fused call may carry on this GPU at this TP size; 0 = never fused."""
    if sm is None or hidden_size <= 0 or dtype_bytes <= 0:
        return 0
    cap = _SIZE_CAP_BYTES.get(int(sm), {}).get(int(tp_size), 0)
    return cap // (hidden_size * dtype_bytes)


def workspace_tokens(sm: int | None, tp_size: int, hidden_size: int, dtype_bytes: int,
                     max_num_batched_tokens: int) -> int:
    """Tokens worth a workspace: calls past the size cap never use it, so don't allocate for them.

    0 means "make no workspace". Per rank the workspace is about
    ``workspace_bytes(tp_size, tokens, hidden_size)``.
    """
    return max(0, min(int(max_num_batched_tokens), size_cap_tokens(sm, tp_size, hidden_size, dtype_bytes)))


def workspace_bytes(tp_size: int, max_tokens: int, hidden_size: int) -> int:
    """Device memory one rank's 16-bit workspace takes (FlashInfer's sizing: a two-shot buffer
    of tp*tokens*hidden*2 bytes plus a Lamport buffer three times that, plus small flags)."""
    one = tp_size * max_tokens * hidden_size * 2
    lamport = min(one, _MAX_LAMPORT_COMM_BYTES) * 3
    return one + lamport


def use_oneshot(tp_size: int, num_tokens: int, hidden: int, dtype_bytes: int, *,
                sm: int | None = None) -> bool:
    """One-shot or two-shot all-reduce inside the fused kernel.

    One-shot: every rank pushes its whole input to every peer (Lamport buffers) and reduces
    all tokens itself - one communication round, ``tp`` times the traffic; it wins while the
    call is latency-bound (few tokens). Two-shot: reduce-scatter then all-gather, each rank
    reducing 1/tp of the tokens - two rounds, less traffic; it wins on large inputs.

    Rules, in order:
      1. ``num_tokens <= tp_size``: one-shot (two-shot splits tokens across ranks and needs
         ``token_num > world_size``; FlashInfer asserts it).
      2. the one-shot Lamport exchange (``tp * input bytes``) past FlashInfer's MAX_COMM_SIZE:
         two-shot.
      3. input bytes <= the per-(arch, TP) one-shot limit (vLLM's table; ``sm=None`` uses
         Hopper's, the most conservative); an arch or TP without an entry uses FlashInfer's
         default of one-shot up to 128 tokens.
    On SM90 at TP 4 and 8 the one-shot limit equals the fusion size cap, so every fused call
    there is one-shot.
    """
    if num_tokens <= tp_size:
        return True
    nbytes = num_tokens * hidden * dtype_bytes
    if nbytes * tp_size > _MAX_LAMPORT_COMM_BYTES:
        return False
    limit = _ONESHOT_MAX_BYTES.get(90 if sm is None else int(sm), {}).get(int(tp_size))
    if limit is None:
        return num_tokens <= _ONESHOT_DEFAULT_MAX_TOKENS
    return nbytes <= limit


def choose_impl(env: KernelEnv, *, dtype, num_tokens: int) -> tuple[str, str | None]:
    """``("flashinfer", None)`` when the kernel can serve this call, else ``("reference", why)``.

    Reasons are short and fixed for a given ``env`` (they name sizes of the workspace and the
    cap, never the call's token count), so counting and logging them once stays bounded.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if _normalize_device(env.device) != "cuda":
        return "reference", f"not CUDA (device {env.device})"
    if env.flashinfer_error is not None:
        return "reference", f"flashinfer unavailable: {env.flashinfer_error}"
    if env.tp_size not in KERNEL_TP_SIZES:
        return "reference", f"tp_size {env.tp_size} not in {KERNEL_TP_SIZES}"
    name = normalize_dtype(dtype)
    if name not in KERNEL_DTYPES:
        return "reference", f"dtype {name} is not bf16/fp16"
    if env.hidden_size % VECTOR_ELEMENTS != 0:
        return "reference", (f"hidden_size {env.hidden_size} not a multiple of {VECTOR_ELEMENTS} "
                             "(16-byte vectors)")
    if env.workspace_max_tokens <= 0:
        return "reference", "no workspace"
    if num_tokens == 0:
        return "reference", "num_tokens == 0"
    if num_tokens > env.workspace_max_tokens:
        return "reference", f"num_tokens > workspace ({env.workspace_max_tokens} tokens)"
    cap = size_cap_tokens(env.sm, env.tp_size, env.hidden_size, DTYPE_BYTES[name])
    if num_tokens > cap:
        return "reference", f"num_tokens > size cap ({cap} tokens for sm{env.sm} tp{env.tp_size})"
    return "flashinfer", None


__all__ = ["KernelEnv", "KERNEL_TP_SIZES", "KERNEL_DTYPES", "DTYPE_BYTES", "VECTOR_ELEMENTS", "normalize_dtype",
           "size_cap_tokens", "workspace_tokens", "workspace_bytes", "use_oneshot", "choose_impl"]
