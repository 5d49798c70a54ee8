"""Rank-side code for tests/test_paged_kv.py: the engine over the paged KV cache on N ranks.

One launch per (framework, TP size) builds one ModelRunner (its cache big enough for every
mode) and runs the same prompts through a fresh engine per mode: prefix caching on (requests
arriving one step apart, so the later ones find the shared prompt's blocks cached), prefix
caching off, and a block budget that holds one sequence of the context limit but not two
of these (preemption).
Rank 0 writes ``result.json``; the other ranks replay each forward until rank 0 says stop.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_LEN, BLOCK, CACHE_BLOCKS = 112, 16, 64
MODES = {"prefix_caching": dict(enable_prefix_caching=True, num_kv_blocks=CACHE_BLOCKS, stagger=True),
         "no_prefix_caching": dict(enable_prefix_caching=False, num_kv_blocks=CACHE_BLOCKS, stagger=True),
         # 9 blocks of 16: room for one sequence of MAX_LEN (7 blocks), not for two of the six
         # prompts at their full length (5 to 7 blocks each): they preempt one another
         "tiny_budget": dict(enable_prefix_caching=True, num_kv_blocks=9, stagger=False)}


def run_modes(args: dict) -> None:
    from glm_fused.backends import get_backend
    from glm_fused.engine import LLMEngine, SamplingParams, run_worker
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    backend = get_backend(args["backend"])
    rank, world = backend.init_distributed()
    if args["backend"] == "torch":
        import torch

        torch.set_num_threads(1)  # tiny model: extra threads only contend on a busy 2-core machine
    base = EngineArgs(model="glm-4.5-air-tiny", tp=world, backend=args["backend"], device="cpu", dtype="float32",
                      max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=128, block_size=BLOCK,
                      num_gpu_blocks_override=CACHE_BLOCKS).resolve()
    runner = ModelRunner(base, base.config(), tp_rank=rank, tp_size=world)
    if rank != 0:
        run_worker(runner, backend.broadcast_int64)
        runner.close()
        return
    broadcast = (lambda a: backend.broadcast_int64(a, src=0)) if world > 1 else None
    params = SamplingParams(max_tokens=args["max_new_tokens"], temperature=0.0, ignore_eos=True)
    result = {}
    engine = None
    for name, mode in MODES.items():
        settings = dataclasses.replace(base, enable_prefix_caching=mode["enable_prefix_caching"],
                                       num_kv_blocks=mode["num_kv_blocks"])
        engine = LLMEngine(runner, settings, vocab_size=base.config().vocab_size, broadcast=broadcast)
        seqs = []
        for i, prompt in enumerate(args["prompts"]):
            seqs.append(engine.add_request(f"{name}-{i}", prompt, params))
            if mode["stagger"]:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        result[name] = {"tokens": [s.output_token_ids for s in seqs], "stats": engine.kv_cache_stats(),
                        "preempted": [s.num_preemptions for s in seqs]}
    engine.stop_workers()
    runner.close()
    (Path(args["out"]) / "result.json").write_text(json.dumps(result))
