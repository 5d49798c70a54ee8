"""CUDA graphs of the decode step: one captured graph per padded batch size.

A decode step at batch 1 is about twenty kernels per layer whose work takes microseconds;
launched one by one from Python, the launches cost more than the work. Captured once and
replayed, the whole stack is one launch. Everything a step changes lives in static device
buffers (token ids, positions, cache slots, key counts) that are refilled before each replay;
the kernels read lengths on the device, so one graph serves every context length.

Batches are padded up to the next captured size; padding rows decode token 0 at position 0
of the scratch KV slot ``pad_slot`` (one slot beyond the engine's), so they never touch a
real sequence (the cost: one more KV slot, 1/max_num_seqs more cache). The fused all-reduce
workspace must exist before capture (the runner makes it first). Graphs share one memory
pool, captured largest first.

An input id of -1 is a placeholder for the token the previous step sampled for that
sequence (the engine schedules a step before the previous one's tokens reach the host):
inside the graph it is read from ``next_tokens[slot]``, the runner's device buffer.
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

    def __init__(self, model, kv_caches: list, max_num_seqs: int, pad_slot: int, next_tokens: torch.Tensor):
        self.model, self.pad_slot = model, pad_slot
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        dev = model.device
        # rows: input ids, positions, slots, keys seen (= position + 1); one copy in per step
        self.inputs = torch.zeros(4, n, dtype=torch.int64, device=dev)
        # Two host staging buffers, taken in turn: the engine fills the next step's while the
        # copy out of the last one may still be queued behind the step running on the device.
        self._staging = [torch.zeros(4, n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._copied = [None, None]  # the event after each buffer's last copy
        self._turn = 0
        self._pinned = self._staging[0]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, FusionStats]] = {}
        self._fill_padding(0)
        self.inputs.copy_(self._pinned)
        pool = None
        comm = model.comm
        for bs in reversed(self.sizes):
            meta = AttentionMetadata.for_decode(self.inputs[2, :bs], self.inputs[1, :bs], self.inputs[3, :bs])

            def step(bs=bs, meta=meta):
                ids, slots = self.inputs[0, :bs], self.inputs[2, :bs]
                ids = torch.where(ids < 0, next_tokens[slots], ids)
                return model.forward_hidden(ids, self.inputs[1, :bs], meta, kv_caches)

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
        pad[0], pad[1], pad[2], pad[3] = 0, 0, self.pad_slot, 1

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.num_seqs <= self.sizes[-1] and bool(np.all(batch.query_lens == 1))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Normed hidden states ``[S, H]`` of a decode batch (one token per sequence)."""
        S = batch.num_seqs
        bs = next(s for s in self.sizes if s >= S)
        self._turn ^= 1
        self._pinned = self._staging[self._turn]
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # two steps back: long done in practice
        host = self._pinned.numpy()
        host[0, :S], host[1, :S], host[2, :S] = batch.input_ids, batch.positions, batch.slots
        host[3, :S] = batch.context_lens + 1
        self._fill_padding(S)
        self.inputs[:, :bs].copy_(self._pinned[:, :bs], non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        graph, out, stats = self.graphs[bs]
        graph.replay()
        self.model.comm.stats.add(stats)
        return out[:S]
