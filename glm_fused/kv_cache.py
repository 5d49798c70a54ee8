"""How big each rank's paged KV cache is, and the context limit that follows from it.

The cache is ``num_blocks`` blocks of ``block_size`` positions (``ModelRunner`` allocates
them, ``engine.block_manager`` hands them out). The count comes from, in this order:

* ``--num-gpu-blocks-override N``: exactly N (tests, CPU runs, reproducible benchmarks);
* on a GPU, ``--gpu-memory-utilization U`` with vLLM's meaning: this process may use the
  fraction U of the GPU's memory; the KV cache gets what is left of it after the weights,
  the peak of a profiled forward of ``--max-num-batched-tokens`` tokens (activations,
  logits) and the memory outside the framework's allocator (CUDA context, NCCL, the fused
  all-reduce workspace);
* on a CPU, room for ``--max-num-seqs`` sequences of the context limit (the memory the
  cache took before it was paged, so nothing is ever preempted by default), at most
  ``CPU_KV_CACHE_BYTES`` per rank (vLLM's default CPU KV space).

Every rank takes the smallest count of any rank (the scheduler on rank 0 uses one number).
The context limit (``--max-model-len``) defaults to the model's own
(``max_position_embeddings``) where the cache holds one sequence that long, otherwise to the
most the cache holds; a limit the user gave that the cache cannot hold once is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm_fused.errors import UserError

CPU_KV_CACHE_BYTES = 4 * 2**30
GiB = 2**30


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    block_size: int
    block_bytes: int      # one block, keys and values of every layer, on this rank
    max_model_len: int
    source: str           # what decided the block count, for the start-up line
    limit_note: str       # why max_model_len is what it is

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        return (f"KV cache {blocks_text(self.num_blocks)} x {self.block_size} tokens = {self.num_tokens} tokens, "
                f"{self.bytes / 2**20:.1f} MiB per rank ({self.source}); "
                f"max-model-len {self.max_model_len} ({self.limit_note})")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gpu_budget(utilization: float, free_at_start: int, total: int, peak: int, outside: int) -> int:
    """Bytes left for the KV cache on one GPU (vLLM's sizing).

    ``free_at_start``: free bytes before this process loaded anything; ``peak``: the most the
    framework's allocator held (weights + a profiled forward); ``outside``: what this process
    took beyond its allocator (CUDA context, communication buffers).
    """
    requested = utilization * total
    if free_at_start < requested:
        raise UserError(f"--gpu-memory-utilization {utilization:g} asks for {requested / GiB:.1f} GiB of the "
                        f"GPU's {total / GiB:.1f} GiB, but only {free_at_start / GiB:.1f} GiB were free at "
                        f"start-up (other processes hold the rest): lower it")
    left = int(requested - peak - outside)
    if left <= 0:
        raise UserError(f"not enough GPU memory for a KV cache: weights and the peak forward take "
                        f"{(peak + outside) / GiB:.1f} GiB of the {requested / GiB:.1f} GiB that "
                        f"--gpu-memory-utilization {utilization:g} allows (raise it, lower "
                        f"--max-num-batched-tokens, or use more --tp ranks)")
    return left


def count_blocks(args, limit: int, block_bytes: int, gpu_bytes: int | None) -> tuple[int, str]:
    """This rank's block count and what decided it. ``gpu_bytes``: the GPU budget (None on CPU)."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override, "--num-gpu-blocks-override"
    if gpu_bytes is not None:
        return gpu_bytes // block_bytes, (f"--gpu-memory-utilization {args.gpu_memory_utilization:g}: "
                                          f"{gpu_bytes / GiB:.2f} GiB left after weights and the peak forward")
    length = args.max_model_len or limit
    wanted = args.max_num_seqs * cdiv(length, args.block_size)
    cap = CPU_KV_CACHE_BYTES // block_bytes
    if wanted <= cap:
        return wanted, f"CPU: {args.max_num_seqs} sequences of {length} tokens"
    return cap, f"CPU: at most {CPU_KV_CACHE_BYTES // GiB} GiB per rank"


def blocks_text(n: int) -> str:
    """The count with its noun, for messages: "1 block", "2 blocks"."""
    return f"{n} block" if n == 1 else f"{n} blocks"


def settle(args, limit: int, num_blocks: int, block_bytes: int, source: str) -> KVCacheSize:
    """The context limit for ``num_blocks`` blocks; raises ``UserError`` when not even one
    sequence fits."""
    bs = args.block_size
    capacity = num_blocks * bs
    hint = ("raise --gpu-memory-utilization or --num-gpu-blocks-override" if args.device == "gpu"
            else "raise --num-gpu-blocks-override")
    if args.max_model_len is not None:
        if capacity < args.max_model_len:
            raise UserError(f"--max-model-len {args.max_model_len}: the KV cache holds {capacity} tokens "
                            f"({blocks_text(num_blocks)} of {bs}; {source}), not one sequence of that length "
                            f"(lower --max-model-len, or {hint})")
        return KVCacheSize(num_blocks, bs, block_bytes, args.max_model_len, source, "--max-model-len")
    if capacity < 2:
        raise UserError(f"not enough memory for a KV cache: {blocks_text(num_blocks)} of {bs} tokens ({source}); {hint}")
    if capacity >= limit:
        return KVCacheSize(num_blocks, bs, block_bytes, limit, source, "the model's limit")
    return KVCacheSize(num_blocks, bs, block_bytes, capacity, source,
                       f"the most the KV cache holds; the model allows {limit}")
