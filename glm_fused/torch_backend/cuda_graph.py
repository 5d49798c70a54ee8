"""CUDA graphs of the decode step: one captured graph per padded batch size.

A decode step at batch 1 is about twenty kernels per layer whose work takes microseconds;
launched one by one from Python, the launches cost more than the work. Captured once and
replayed, the whole stack is one launch. Everything a step changes lives in static device
buffers (token ids, positions, cache rows, key counts, block tables) that are refilled before
each replay; the kernels read lengths and block tables on the device, so one graph serves
every context length.

Batches are padded up to the next captured size; padding rows decode token 0 at position 0
with cache row -1 (the RoPE + KV-write kernel skips it, so no block is ever written) and
read one key of block 0 (any block will do: the result is dropped). The block tables are
``[max_num_seqs, max_blocks_per_seq]`` int32; a step copies the first ``batch size`` rows in
full (contiguous, so one asynchronous copy from pinned memory: at 131,072 positions and
16-token blocks that is 32 KiB per row). The fused all-reduce workspace must exist before
capture (the runner makes it first). Graphs share one memory pool, captured largest first.

A short prompt chunk replays the same graphs (``run`` takes any batch ``can_run`` accepts): each
of its tokens becomes a row of its own (``ForwardBatch.as_token_rows``), at its position, over
its sequence's block table, with position + 1 keys - the causal mask, since every row's key is
written before any row attends.
Eagerly, a lone 32-token prompt waited 24 ms for its first token on a 20-layer model whose
decode step takes 3.9 ms (an H200): the step was mostly launches; replayed, 15.4 ms (fresh
prompts, docs/speed.md). The rows
re-read their sequence's keys, so a step qualifies only while the keys its chunks read, sum of
query_len * (context + query_len), stay within PROMPT_KEY_READS (about what a full decode batch
at 2,048 tokens reads). Such steps replay a second graph of the same size whose attention takes
a chunk's rows in groups (``decode_attention``'s ``lead``): one program per group of
GROUP_ROWS rows reads each key tile once for all of them, where one program per row read it
once per row (32 rows after 2,048 cached tokens: docs/speed.md).

An input id of -1 is a placeholder for the token the previous step sampled for that
sequence (the engine schedules a step before the previous one's tokens reach the host):
inside the graph it is read from ``next_tokens[row]``, the runner's device buffer. The host
staging is double-buffered: the engine fills the next step's inputs while the copy out of
the last one may still be queued behind the step running on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from glm_fused.batch import ForwardBatch
from glm_fused.fused_op.stats import FusionStats
from glm_fused.model.attention import AttentionMetadata
from glm_fused.torch_backend.kernels.decode_attention import row_groups


PROMPT_KEY_READS = 64 * 2048  # a step with prompt chunks replays a graph up to this many key reads (docstring)
# A step with prompt chunks replays the grouped graph (``grouped``) when a chunk follows at
# least GROUPED_MIN_CONTEXT cached positions and the chunks' rows read at least twice the keys
# its decodes read. Measured per layer on an H200 (docs/speed.md, 2026-12-04, the kernel as
# now): 32 rows after 256 cached tokens 1.09x the ungrouped time, after 384 0.88x, after 512
# 0.78x, after 1,024 0.53x (64 rows: 1.12x, 0.91x, 0.79x); 32 decodes beside a chunk of 32
# after 1,024 1.42x (the decodes' launch and the groups' run one after the other).
GROUPED_MIN_CONTEXT = 384
# A padding row's inputs: token 0 at position 0, cache row -1 (not written), one key to read,
# state row 0, a group of one.
PADDING = np.array([0, 0, -1, 1, 0, 1], dtype=np.int64)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the engine's batch limit (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """The captured decode steps of one model and KV cache; ``run(batch)`` replays one."""

    def __init__(self, model, kv_caches: list, max_num_seqs: int, max_blocks_per_seq: int,
                 next_tokens: torch.Tensor):
        self.model = model
        self.block_size = int(kv_caches[0][0].shape[1])
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        dev = model.device
        # rows: input ids, positions, cache rows, keys seen (= position + 1), the sequence's row
        # of per-sequence state, the attention's row groups (grouped graphs); one copy in per step
        self.inputs = torch.zeros(6, n, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._staging = [(torch.zeros(6, n, dtype=torch.int64, pin_memory=True),
                          torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, pin_memory=True)) for _ in range(2)]
        # recorded after each staging pair's last copy; re-recorded, not made anew, each step
        # (one never recorded is synchronized at once)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self._pinned, self._pinned_tables = self._staging[0]
        # per size: the decode graph, and (sizes above 1) the grouped one for steps with prompt chunks
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, FusionStats]] = {}
        self.grouped_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, FusionStats]] = {}
        self._fill_padding(0)
        self.inputs.copy_(self._pinned)
        self._pool = None
        for bs in reversed(self.sizes):
            self.graphs[bs] = self._capture(bs, next_tokens, kv_caches, grouped=False)
            if bs > 1:
                self.grouped_graphs[bs] = self._capture(bs, next_tokens, kv_caches, grouped=True)
        torch.cuda.synchronize(dev)
        model.comm.stats.reset()

    def _capture(self, bs: int, next_tokens, kv_caches, grouped: bool):
        model, comm = self.model, self.model.comm
        meta = AttentionMetadata.for_decode(self.inputs[2, :bs], self.tables[:bs], self.inputs[3, :bs],
                                            self.block_size, row_groups=self.inputs[5, :bs] if grouped else None)

        def step():
            ids = self.inputs[0, :bs]
            ids = torch.where(ids < 0, next_tokens[self.inputs[4, :bs]], ids)
            return model.forward_hidden(ids, self.inputs[1, :bs], meta, kv_caches)

        step()  # compile and warm every kernel outside the capture
        torch.cuda.synchronize(model.device)
        graph = torch.cuda.CUDAGraph()
        comm.stats.reset()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool() if self._pool is None else self._pool
        stats = FusionStats()
        stats.add(comm.stats)  # what one replay does: the calls made while capturing
        return graph, out, stats

    def _fill_padding(self, start: int) -> None:
        # Through numpy views of the pinned buffers: seven torch slice assignments took 0.1 ms
        # of the host's time before the replay (an H200's host, profiled).
        self._pinned.numpy()[:, start:] = PADDING[:, None]
        self._pinned_tables.numpy()[start:, 0] = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        chunks = batch.query_lens > 1
        key_reads = int((batch.query_lens[chunks] * (batch.context_lens[chunks] + batch.query_lens[chunks])).sum())
        return (batch.num_tokens <= self.sizes[-1] and key_reads <= PROMPT_KEY_READS
                and batch.block_tables.shape[1] <= self.tables.shape[1])

    @staticmethod
    def grouped(batch: ForwardBatch) -> bool:
        """Replay the grouped graph for this step with prompt chunks? (GROUPED_MIN_CONTEXT)"""
        chunk = batch.query_lens > 1
        if not (batch.context_lens[chunk] >= GROUPED_MIN_CONTEXT).any():
            return False
        reads = batch.query_lens * (batch.context_lens + batch.query_lens)  # a decode: its keys
        return int(reads[chunk].sum()) >= 2 * int(reads[~chunk].sum())

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Normed hidden states ``[T, H]`` of a batch ``can_run`` accepts: one row per token."""
        chunked = batch.num_tokens != batch.num_seqs
        grouped = chunked and self.grouped(batch)
        if chunked:
            batch = batch.as_token_rows()
        S = batch.num_seqs
        bs = next(s for s in self.sizes if s >= S)
        self._turn ^= 1
        self._pinned, self._pinned_tables = self._staging[self._turn]
        self._copied[self._turn].synchronize()  # two steps back: long done in practice
        host = self._pinned.numpy()
        host[0, :S], host[1, :S] = batch.input_ids, batch.positions
        host[2, :S] = batch.slot_mapping(self.block_size)
        host[3, :S] = batch.context_lens + 1
        host[4, :S] = batch.rows
        if grouped:
            host[5, :S] = row_groups(batch.rows)
        self._fill_padding(S)
        self._pinned_tables.numpy()[:S, :batch.block_tables.shape[1]] = batch.block_tables
        # All of it: [:, :bs] is a strided view, which torch copies through a pageable host
        # copy and an extra kernel; the whole buffer is one DMA of pinned memory (3 KiB at 64 rows).
        self.inputs.copy_(self._pinned, non_blocking=True)
        self.tables[:bs].copy_(self._pinned_tables[:bs], non_blocking=True)
        self._copied[self._turn].record()
        graph, out, stats = (self.grouped_graphs if grouped else self.graphs)[bs]
        graph.replay()
        self.model.comm.stats.add(stats)
        return out[:S]
