"""Start-up, load time and peak memory per rank, for a checkpoint of a few GB made here.

``python scripts/bench_load.py --dir /some/disk/ckpt --tp 4`` writes (once) a GLM-4.5-shaped
checkpoint of about 3.4 GB in bfloat16 with ``glm_fused.tiny.write_tiny_checkpoint``, then
starts ``--tp`` ranks that each build a ModelRunner from it and report:

- start-up: seconds from launch until every rank has its process group (import + init),
- load: seconds to build the model and read this rank's slices,
- memory: peak RSS before loading (the baseline: interpreter + framework), peak RSS after,
  the rank's parameter bytes (its shard), and ``(peak - baseline) / shard`` — near 1.0 means
  the loader holds little beyond the shard itself.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from bench.common import BenchRank, launch_ranks

# ~1.7 B parameters: 5 MoE layers of 64 experts dominate, as in the real model.
FEW_GB = {
    "hidden_size": 2048, "num_hidden_layers": 6, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 5632, "moe_intermediate_size": 768, "n_routed_experts": 64,
    "num_experts_per_tok": 8, "vocab_size": 32768, "torch_dtype": "bfloat16",
}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(args: dict) -> None:
    t_start = time.time()
    from glm_fused.config import Glm4MoeConfig

    ctx = BenchRank(args, backend=args["backend"])
    rank, world = ctx.rank, ctx.world
    ctx.barrier()
    t_ready = time.time()
    base_rss = _peak_rss_bytes()
    config = Glm4MoeConfig.from_pretrained(args["dir"])
    t0 = time.perf_counter()
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    engine_args = EngineArgs(model=args["dir"], tp=world, backend=args["backend"], device="cpu", dtype="float32",
                             fusion_impl="reference", max_num_seqs=1, max_model_len=16,
                             max_num_batched_tokens=16).resolve()
    runner = ModelRunner(engine_args, config, tp_rank=rank, tp_size=world)
    load_s = time.perf_counter() - t0
    peak = _peak_rss_bytes()
    shard = sum(int(p.numel()) * 4 for p in runner.model.parameters())  # fp32 parameters
    kv = sum(int(t.numel()) * 4 for pair in runner.kv_caches for t in pair)
    ctx.save(rank=rank, startup_s=t_ready - args["launched_at"], import_init_s=t_ready - t_start, load_s=load_s,
             baseline_rss=base_rss, peak_rss=peak, shard_bytes=shard + kv)
    runner.close()


def main(argv: list[str] | None = None) -> int:
    from glm_fused.tiny import write_tiny_checkpoint

    p = argparse.ArgumentParser(prog="bench_load.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (written first when it has no config.json)")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--backend", default="paddle", choices=["paddle", "torch"])
    args = p.parse_args(argv)
    ckpt = Path(args.dir)
    if not (ckpt / "config.json").exists():
        if ckpt.exists() and any(ckpt.iterdir()):
            print(f"error: --dir {ckpt}: exists, is not empty and has no config.json", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        write_tiny_checkpoint(ckpt, config_overrides=FEW_GB)
        print(f"wrote {ckpt} in {time.perf_counter() - t0:.1f} s")
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    status, reports = launch_ranks("bench.bench_load:worker", {"dir": str(ckpt), "backend": args.backend,
                                                                "launched_at": time.time()}, nprocs=args.tp)
    if status:
        return status
    rows = [reports[r] for r in sorted(reports)]
    gib = 2**30
    print(f"checkpoint {size / gib:.2f} GiB on disk (bf16), {args.backend} backend, TP {args.tp}, float32 in memory")
    print(f"{'rank':>4} {'start-up s':>10} {'load s':>7} {'baseline GiB':>12} {'peak GiB':>9} "
          f"{'shard GiB':>9} {'(peak-base)/shard':>17}")
    for r in rows:
        ratio = (r["peak_rss"] - r["baseline_rss"]) / r["shard_bytes"]
        print(f"{r['rank']:>4} {r['startup_s']:>10.1f} {r['load_s']:>7.1f} {r['baseline_rss'] / gib:>12.2f} "
              f"{r['peak_rss'] / gib:>9.2f} {r['shard_bytes'] / gib:>9.2f} {ratio:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
