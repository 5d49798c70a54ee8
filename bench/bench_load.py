"""Checkpoint load speed: plain safetensors against the model's from_pretrained, same files, one run.

    python scripts/bench_load.py --dir CKPT                                  # CPU: Paddle and torch
    python scripts/bench_load.py --dir CKPT --device gpu --backend torch     # GPU: Air sizes, ~7 GiB
    python scripts/bench_load.py --dir CKPT8 --device gpu --backend torch --fp8  # the same in fp8

``--dir`` gets a checkpoint first when it has no config.json: GLM-4.5-Air's layer widths
(hidden 4096, 96 heads and 8 KV heads of 128, dense width 10944, expert width 1408), 2 layers
(1 dense + 1 MoE), random bf16 values written by safetensors. ``--size air`` (the GPU default)
keeps every other real size too (128 experts, vocabulary 151552: 7.1 GiB); ``--size small`` (the
CPU default) has 4 experts and a vocabulary of 8192 (0.94 GiB). Every file is read once first
(page cache warm); then each measurement runs in fresh processes:

* plain: one process reads every tensor with safetensors' ``safe_open`` (torch: framework
  "pt", on a GPU ``device="cuda"``; Paddle: framework "paddle") and, on the CPU, casts it to
  the model dtype (a copy when the dtypes agree);
* TP n: n processes (the launcher's ranks; on a GPU host with one GPU all share it), each
  ``Glm4MoeForCausalLM.from_pretrained(dir, tp_rank=r, tp_size=n, dtype=...)``: the model built
  on its device and its slices loaded, started together after a barrier.

On a GPU every process makes its CUDA context before its clock starts.

Printed per rank: checkpoint bytes read (as stored), seconds, GiB/s, the rate against the plain
rate, and on the CPU the peak RSS above the rank's baseline (after imports) per byte of its
in-memory parameters. TP n total: all ranks' bytes over the wall time of the whole load (first
start to last finish), against the plain single-process rate. ``--repeat N`` runs each
measurement N times and keeps the fastest (a busy host slows single runs at random). Targets
(issue 16): GPU TP 1 rate >= 0.9x plain and TP 4 total >= 0.8x; CPU TP 1 time <= 1.3x plain;
peak RSS <= 1.2x parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from bench.common import AIR_CONFIG, REPO, BenchRank, launch_ranks, text_table, write_json
from glm_fused.errors import UserError

GIB = 2**30
SHARD_BYTES = 4 * GIB  # about the real checkpoints' shards (4.4 GiB)
SIZES = {
    "air": {},
    "small": {"n_routed_experts": 4, "num_experts_per_tok": 2, "vocab_size": 8192},
}


# ---- the checkpoint ---------------------------------------------------------------------

# The Linear weights an fp8 checkpoint stores as e4m3 (zai-org/GLM-4.5-Air-FP8's scheme).
FP8_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?"
                        r"(gate|up|down)_proj)\.weight$")


def write_checkpoint(path: Path, size: str, fp8: bool = False) -> float:
    """GLM-4.5-Air widths, 2 layers, no MTP block, bf16 (router bias fp32), sharded as real
    checkpoints are; returns the bytes of tensor data. Values repeat a pool of random bf16 from a
    per-tensor offset: load speed does not depend on them, and i.i.d. draws of 7 GiB would cost
    minutes of the GPU host's time. ``fp8``: the decoder Linears as e4m3 codes (random, never
    NaN) with bf16 row scales ``[out, 1]``, compressed-tensors' layout and config, as the
    official FP8 release."""
    from safetensors import TensorSpec, serialize_file

    from glm_fused.tiny import TensorSpec as Spec, tensor_specs

    raw = json.loads(AIR_CONFIG.read_text())
    raw.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0, torch_dtype="bfloat16",
               **SIZES[size])
    if raw["vocab_size"] <= max(raw["eos_token_id"]):
        raw.update(pad_token_id=raw["vocab_size"] - 1, eos_token_id=[raw["vocab_size"] - 1])
    specs, codes = [], set()
    for spec in tensor_specs(raw):
        specs.append(spec)
        if fp8 and FP8_LINEAR.match(spec.name):
            codes.add(spec.name)
            specs.append(Spec(spec.name + "_scale", (spec.shape[0], 1), "normal", 0.01))
    rng = np.random.default_rng(0)
    pool = ((rng.standard_normal(2**22, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    # e4m3 bit patterns: any exponent and mantissa but the NaN pattern (0x7f), either sign
    pool8 = (rng.integers(0, 0x7F, 2**22, dtype=np.uint8) | (rng.integers(0, 2, 2**22, dtype=np.uint8) << 7))

    def values(spec) -> np.ndarray:
        n = math.prod(spec.shape)
        if spec.fp32:
            return rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(0.01)
        src = pool8 if spec.name in codes else pool
        out, at, start = np.empty(n, dtype=src.dtype), 0, zlib.crc32(spec.name.encode()) % len(src)
        while at < n:
            k = min(n - at, len(src) - start)
            out[at:at + k] = src[start:start + k]
            at, start = at + k, 0
        if spec.name.endswith("_scale"):
            out &= 0x7FFF  # scales are positive: bf16 with the sign bit clear
        return out.reshape(spec.shape)

    def dtype(spec) -> str:
        return "float32" if spec.fp32 else "float8_e4m3fn" if spec.name in codes else "bfloat16"

    nbytes = [math.prod(s.shape) * (4 if s.fp32 else 1 if s.name in codes else 2) for s in specs]
    total = sum(nbytes)
    num_shards = max(1, math.ceil(total / SHARD_BYTES))
    path.mkdir(parents=True, exist_ok=True)
    weight_map, done = {}, 0
    shards: list[list] = [[] for _ in range(num_shards)]
    for spec, n in zip(specs, nbytes):
        shards[min(num_shards - 1, done * num_shards // total)].append(spec)
        done += n
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        arrays = {s.name: (values(s), dtype(s)) for s in shard}
        serialize_file({n: TensorSpec(dtype=d, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
                        for n, (a, d) in arrays.items()}, str(path / name), metadata={"format": "pt"})
        (path / name).chmod(0o644)  # the writer makes owner-only files
        del arrays
        weight_map.update((s.name, name) for s in shard)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if fp8:
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}},
            "ignore": ["lm_head", *[f"model.layers.{i}.mlp.gate" for i in range(raw["first_k_dense_replace"],
                                                                             raw["num_hidden_layers"])]]}
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return total


def warm(files: list[Path]) -> float:
    """Read every file once (into the page cache); returns seconds."""
    t0 = time.perf_counter()
    buf = bytearray(64 * 2**20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


# ---- the ranks --------------------------------------------------------------------------

def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _start_device(backend: str, gpu: bool) -> None:
    """Create the CUDA context before any clock starts: both paths would pay it once per process."""
    if not gpu:
        return
    if backend == "torch":
        import torch

        torch.zeros(1, device="cuda")
    else:
        import paddle

        paddle.zeros([1])
    _sync(backend, gpu)


def _sync(backend: str, gpu: bool) -> None:
    if not gpu:
        return
    if backend == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import paddle

        paddle.device.synchronize()


def plain_worker(args: dict) -> None:
    """One process: every tensor of every file through safe_open, cast on the CPU / to the GPU."""
    from safetensors import safe_open

    ctx = BenchRank(args, backend=args["backend"])
    gpu, keep = args["device"] == "gpu", []
    _start_device(args["backend"], gpu)
    files = sorted(Path(args["dir"]).glob("*.safetensors"))
    if args["backend"] == "torch":
        import torch

        dtype, device = getattr(torch, args["dtype"]), str(ctx.device)
        t0 = time.perf_counter()
        for f in files:
            with safe_open(str(f), framework="pt", device=device) as h:
                for k in h.keys():
                    t = h.get_tensor(k)
                    keep.append(t if gpu else t.to(dtype, copy=True))
    else:
        import paddle

        device = f"cuda:{paddle.distributed.ParallelEnv().dev_id}" if gpu else "cpu"
        t0 = time.perf_counter()
        for f in files:
            with safe_open(str(f), framework="paddle", device=device) as h:
                for k in h.keys():
                    t = h.get_tensor(k)
                    keep.append(t if gpu else (t.clone() if str(t.dtype).endswith(args["dtype"])
                                               else t.astype(args["dtype"])))
    _sync(args["backend"], gpu)
    ctx.save(seconds=time.perf_counter() - t0, tensors=len(keep))


def model_worker(args: dict) -> None:
    """One rank: from_pretrained of its slices, timed from a common start."""
    from glm_fused.backends import get_backend
    from glm_fused.checkpoint import Checkpoint, iter_rank_plan
    from glm_fused.config import Glm4MoeConfig
    from glm_fused.sharding import TPShard

    ctx = BenchRank(args, backend=args["backend"])
    rank, world = ctx.rank, ctx.world
    cls = get_backend(args["backend"]).Glm4MoeForCausalLM
    gpu = args["device"] == "gpu"
    _start_device(args["backend"], gpu)
    ctx.barrier()
    base = _peak_rss()
    start = time.time()
    model = cls.from_pretrained(args["dir"], tp_rank=rank, tp_size=world, dtype=args["dtype"], max_position=4096)
    _sync(args["backend"], gpu)
    end = time.time()
    peak = _peak_rss()
    param_bytes = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    config = Glm4MoeConfig.from_pretrained(args["dir"])
    read = sum(part.nbytes for _, plan in iter_rank_plan(Checkpoint(args["dir"]), config,
                                                          TPShard(config, rank, world)) for part in plan.parts)
    ctx.save(rank=rank, start=start, end=end, seconds=end - start, bytes=read, param_bytes=param_bytes,
             base_rss=base, peak_rss=peak)


# ---- the run ----------------------------------------------------------------------------

def _installed(backend: str) -> bool:
    return importlib.util.find_spec("paddle" if backend == "paddle" else "torch") is not None


def fresh_launch(worker: str, common: dict, nprocs: int, args) -> tuple[int, dict[int, dict]]:
    """``launch_ranks`` from a new Python process: the launcher runs one rank in its own process,
    and each measurement must start from a fresh interpreter (its own peak RSS, no memory left by
    an earlier one to reuse)."""
    payload = json.dumps({"worker": worker, "args": common, "nprocs": nprocs, "device": args.device,
                          "timeout": args.timeout, "num_gpus": args.num_gpus})
    proc = subprocess.run([sys.executable, "-m", "bench.bench_load", "--child", payload], cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
    last = proc.stdout.strip().splitlines()[-1:] or ["{}"]
    try:
        out = json.loads(last[0])
    except ValueError:
        return proc.returncode or 1, {}
    return out.get("code", proc.returncode), {int(r): v for r, v in out.get("reports", {}).items()}


def _child(payload: str) -> int:
    job = json.loads(payload)
    code, reports = launch_ranks(job["worker"], job["args"], nprocs=job["nprocs"], device=job["device"],
                                 timeout=job["timeout"], num_gpus=job["num_gpus"])
    print(json.dumps({"code": code, "reports": reports}), flush=True)
    return 0


def _wall(ranks: list[dict]) -> float:
    return max(r["end"] for r in ranks) - min(r["start"] for r in ranks)


def bench_backend(args, backend: str, data_bytes: int) -> tuple[list[list], dict]:
    common = {"dir": str(args.dir), "backend": backend, "device": args.device, "dtype": args.dtype}
    plain_s = math.inf
    for _ in range(args.repeat):
        code, reports = fresh_launch("bench.bench_load:plain_worker", common, 1, args)
        if code:
            raise UserError(f"{backend}: the plain safetensors read failed (exit {code})")
        plain_s = min(plain_s, reports[0]["seconds"])
    plain_rate = data_bytes / plain_s
    reader = "pt" if backend == "torch" else "paddle"
    what = "to the GPU" if args.device == "gpu" else f"read + cast to {args.dtype}"
    rows = [[f"plain safe_open({reader}) {what}", 1, "-", f"{data_bytes / GIB:.2f}", f"{plain_s:.2f}",
             f"{plain_rate / GIB:.2f}", "1.00", "-"]]
    out = {"plain": {"bytes": data_bytes, "seconds": plain_s}, "tp": {}}
    for tp in args.tp:
        ranks = None
        for _ in range(args.repeat):  # the run with the shortest wall time
            code, reports = fresh_launch("bench.bench_load:model_worker", common, tp, args)
            if code or len(reports) != tp:
                raise UserError(f"{backend}: from_pretrained at TP {tp} failed (exit {code})")
            run = [reports[r] for r in range(tp)]
            if ranks is None or _wall(run) < _wall(ranks):
                ranks = run
        for r in ranks:
            rate = r["bytes"] / r["seconds"]
            mem = "-" if args.device == "gpu" else f"{(r['peak_rss'] - r['base_rss']) / r['param_bytes']:.2f}"
            ratio = f"{rate / plain_rate:.2f}" + (f" (time {r['seconds'] / plain_s:.2f}x)" if tp == 1 else "")
            rows.append([f"from_pretrained TP {tp}", tp, r["rank"], f"{r['bytes'] / GIB:.2f}", f"{r['seconds']:.2f}",
                         f"{rate / GIB:.2f}", ratio, mem])
        if tp > 1:
            total, wall = sum(r["bytes"] for r in ranks), _wall(ranks)
            rows.append([f"TP {tp} total: {tp} ranks' bytes / wall", tp, "all", f"{total / GIB:.2f}", f"{wall:.2f}",
                         f"{total / wall / GIB:.2f}", f"{total / wall / plain_rate:.2f}", "-"])
        out["tp"][tp] = ranks
    return rows, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dir", type=Path, required=True,
                   help="checkpoint directory (written first when it has no config.json)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--backend", default="paddle,torch", help="comma-separated: paddle, torch (default: both)")
    p.add_argument("--tp", default="1,4", help="TP sizes, comma-separated (default 1,4)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="model dtype (default: float32 on cpu, bfloat16 on gpu)")
    p.add_argument("--size", choices=sorted(SIZES), help="checkpoint to write when --dir has none "
                                                         "(default: small on cpu, air on gpu)")
    p.add_argument("--fp8", action="store_true", help="the checkpoint written has fp8 Linears (compressed-tensors, "
                                                      "one bf16 scale per row), as the official FP8 release")
    p.add_argument("--num-gpus", type=int, help="GPUs the ranks spread over (default: every visible one)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each measurement this many times (fresh processes) and keep the fastest")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--json", type=Path, help="also write every figure here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1])
    args = build_parser().parse_args(argv)
    try:
        args.tp = [int(x) for x in args.tp.split(",") if x.strip()]
    except ValueError:
        print(f"error: --tp {args.tp!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "gpu" else "float32")
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or any(b not in ("paddle", "torch") for b in backends):
        print(f"error: --backend {args.backend!r}: choose from paddle, torch", file=sys.stderr)
        return 2
    if not (args.dir / "config.json").exists():
        if args.dir.exists() and any(args.dir.iterdir()):
            print(f"error: --dir {args.dir}: exists, is not empty and has no config.json", file=sys.stderr)
            return 2
        size = args.size or ("air" if args.device == "gpu" else "small")
        t0 = time.perf_counter()
        written = write_checkpoint(args.dir, size, fp8=args.fp8)
        print(f"wrote {args.dir} ({size}: {written / GIB:.2f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
    files = sorted(args.dir.glob("*.safetensors"))
    from glm_fused.safetensors_io import SafetensorsFile

    data_bytes = sum(h.nbytes(k) for h in map(SafetensorsFile, files) for k in h.keys())
    config = json.loads((args.dir / "config.json").read_text())
    print(f"checkpoint {args.dir}: {data_bytes / GIB:.2f} GiB of tensors in {len(files)} files, "
          f"{config['num_hidden_layers']} layers, {config['n_routed_experts']} experts, vocab {config['vocab_size']}; "
          f"page cache warmed in {warm(files):.1f} s", flush=True)
    results = {"checkpoint_bytes": data_bytes, "device": args.device, "dtype": args.dtype, "backends": {}}
    for backend in backends:
        if not _installed(backend):
            print(f"\n{backend}: not installed, skipped")
            continue
        try:
            rows, results["backends"][backend] = bench_backend(args, backend, data_bytes)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"\n{backend}, {args.device}, model dtype {args.dtype}")
        print(text_table(["path", "procs", "rank", "GiB read", "s", "GiB/s", "rate / plain",
                          "(peak RSS - base) / params"], rows), flush=True)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
