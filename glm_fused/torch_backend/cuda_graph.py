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
"""

from __future__ import annotations

import numpy as np
import torch

from glm_fused.batch import ForwardBatch
from glm_fused.fused_op.stats import FusionStats
from glm_fused.model.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the engine's batch limit (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """The captured decode steps of one model and KV cache; ``run(batch)`` replays one."""

    def __init__(self, model, kv_caches: list, max_num_seqs: int, max_blocks_per_seq: int):
        self.model = model
        self.block_size = int(kv_caches[0][0].shape[1])
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        dev = model.device
        # rows: input ids, positions, cache rows, keys seen (= position + 1); one copy in per step
        self.inputs = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self._pinned = torch.zeros(4, n, dtype=torch.int64, pin_memory=True)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._pinned_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, FusionStats]] = {}
        self._fill_padding(0)
        self.inputs.copy_(self._pinned)
        pool = None
        comm = model.comm
        for bs in reversed(self.sizes):
            meta = AttentionMetadata.for_decode(self.inputs[2, :bs], self.tables[:bs], self.inputs[3, :bs],
                                                self.block_size)

            def step(bs=bs, meta=meta):
                return model.forward_hidden(self.inputs[0, :bs], self.inputs[1, :bs], meta, kv_caches)

            step()  # compile and warm every kernel outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            comm.stats.reset()
            with torch.cuda.graph(graph, pool=pool):
                out = step()
            pool = graph.pool() if pool is None else pool
            stats = FusionStats()
            stats.add(comm.stats)  # what one replay does: the calls made while capturing
            self.graphs[bs] = (graph, out, stats)
        torch.cuda.synchronize(dev)
        comm.stats.reset()

    def _fill_padding(self, start: int) -> None:
        pad = self._pinned[:, start:]
        pad[0], pad[1], pad[2], pad[3] = 0, 0, -1, 1
        self._pinned_tables[start:, 0] = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.num_seqs <= self.sizes[-1] and bool(np.all(batch.query_lens == 1))
                and batch.block_tables.shape[1] <= self.tables.shape[1])

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Normed hidden states ``[S, H]`` of a decode batch (one token per sequence)."""
        S = batch.num_seqs
        bs = next(s for s in self.sizes if s >= S)
        host = self._pinned.numpy()
        host[0, :S], host[1, :S] = batch.input_ids, batch.positions
        host[2, :S] = batch.slot_mapping(self.block_size)
        host[3, :S] = batch.context_lens + 1
        self._fill_padding(S)
        self._pinned_tables.numpy()[:S, :batch.block_tables.shape[1]] = batch.block_tables
        self.inputs[:, :bs].copy_(self._pinned[:, :bs], non_blocking=True)
        self.tables[:bs].copy_(self._pinned_tables[:bs], non_blocking=True)
        graph, out, stats = self.graphs[bs]
        graph.replay()
        self.model.comm.stats.add(stats)
        return out[:S]
