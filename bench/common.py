"""What the benchmarks and GPU checks share: where the repository is, the GPU environment they
set, comma-separated list flags, configs cut to fewer layers, timing and the device's ceilings,
report writers, and ranks started through ``glm_fused.launcher.launch``.

torch is imported inside the functions that need it, so bench_serve and a Paddle bench_load
never load it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from glm_fused.errors import UserError

REPO = Path(__file__).resolve().parents[1]
AIR_CONFIG = REPO / "configs" / "glm-4.5-air.json"
TINY_CONFIG = REPO / "configs" / "glm-4.5-air-tiny.json"

# NVLink multicast stays off: on a shared host it can take the GPUs down for others.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# flashinfer.norm's CUDA kernels, the path this project uses (its CuTe-DSL ones need
# nvidia-cutlass-dsl, which is not installed). Set before anything imports flashinfer.norm.
CUDA_NORM_ENV = {"FLASHINFER_USE_CUDA_NORM": "1"}


# ---- list flags ------------------------------------------------------------------------

TP_RELATIVE = ("tp-1", "tp", "tp+1")


def int_list(text) -> list[int]:
    """``1,8,32``: an argparse ``type`` for comma-separated integers."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def token_list(text) -> list:
    """``1,tp-1,tp+1,16``: integers, or tp-1 / tp / tp+1 (resolved per TP size by ``token_counts``)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    try:
        return [x if x in TP_RELATIVE else int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers or tp-1/tp/tp+1, got {text!r}") from None


def token_counts(tp: int, max_tokens: int, tokens) -> list[int]:
    """``tokens`` for one TP size: tp-1 / tp / tp+1 resolved, deduplicated, sorted, within 1..max_tokens."""
    out = set()
    for t in tokens:
        n = {"tp-1": tp - 1, "tp": tp, "tp+1": tp + 1}.get(t, t) if isinstance(t, str) else int(t)
        if 0 < n <= max_tokens:
            out.add(n)
    return sorted(out)


def name_list(text, allowed, flag: str) -> list[str]:
    """``check,timing``: comma-separated names, each one of ``allowed``; a UserError names the flag."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names or any(n not in allowed for n in names):
        raise UserError(f"{flag} {text}: choose from {', '.join(allowed)}")
    return names


# ---- configs ---------------------------------------------------------------------------

def load_config(path, num_hidden_layers: int | None = None):
    """The config of a config.json, optionally cut to ``num_hidden_layers`` (the dense layers
    kept within them), checked again as a config file is."""
    from glm_fused.config import Glm4MoeConfig

    config = Glm4MoeConfig.from_json_file(path)
    if num_hidden_layers is None:
        return config
    raw = config.to_dict()
    raw["num_hidden_layers"] = num_hidden_layers
    raw["first_k_dense_replace"] = min(raw["first_k_dense_replace"], num_hidden_layers)
    return Glm4MoeConfig.from_dict(raw, source=f"{path} cut to {num_hidden_layers} layers")


# ---- timing and the device's ceilings -------------------------------------------------

def torch_device(kind: str):
    """``gpu``: CUDA device 0, made current; ``cpu``: the CPU."""
    import torch

    if kind == "gpu":
        if not torch.cuda.is_available():
            raise RuntimeError("--device gpu: torch sees no CUDA device")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int, iters: int) -> float:
    """Mean wall time of one call, after warm-up; the device is drained before and after."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def graphed(fn, device):
    """``fn`` captured in a CUDA graph (after one eager call that compiles and warms every
    kernel); the replay is what a served decode step runs."""
    import torch

    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


def copy_bandwidth(device, mib: int, iters: int = 20) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting the bytes read and the bytes written."""
    import torch

    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=iters)
    return 2 * n / (ms / 1e3)


def matmul_rate(device, n: int, dtype, iters: int = 20) -> float:
    """FLOP per second of an n x n x n matmul in ``dtype`` (2 FLOP per multiply-add)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, iters=iters)
    return 2 * n ** 3 / (ms / 1e3)


def environment() -> dict:
    """Date, versions, GPU and driver, for the head of a report (never raises: sections say what they need)."""
    info = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["sm"] = p.major * 10 + p.minor
            info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            info["multiprocessors"] = p.multi_processor_count
    except Exception as exc:
        info["torch_error"] = repr(exc)
    for mod in ("flashinfer", "tvm_ffi"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:
            info[mod] = f"not importable ({type(exc).__name__})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["driver"] = out.splitlines()[0] if out else None
    except Exception:
        info["driver"] = None
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
        info["nvcc"] = next((ln.strip() for ln in out.splitlines() if "release" in ln), None)
    except Exception:
        info["nvcc"] = None
    return info


# ---- reports ---------------------------------------------------------------------------

def md_table(header: list, rows: list[list]) -> str:
    """A Markdown table (pastes into docs/ as it is)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: list, rows: list[list]) -> str:
    """A console table: every column padded to its widest cell, two spaces apart."""
    header, rows = [str(h) for h in header], [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [header, *rows])


def write_text(path, text: str) -> Path:
    """Write through a temporary file and a rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
    return path


def write_json(path, data, *, indent: int | None = 1) -> Path:
    return write_text(path, json.dumps(data, indent=indent, default=str))


def read_json(path) -> dict | None:
    """The JSON object in ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


# ---- ranks -----------------------------------------------------------------------------

def launch_ranks(worker: str, args: dict, *, nprocs: int, device: str = "cpu", timeout: float | None = None,
                 num_gpus: int | None = None) -> tuple[int, dict[int, dict]]:
    """Run ``worker(args)`` on ``nprocs`` ranks with ``glm_fused.launcher.launch``, the one way
    this repository starts ranks; return its exit status and what each rank last saved with
    ``BenchRank.save`` (``{rank: report}``; a rank that saved nothing is absent).

    ``device="gpu", num_gpus=1`` puts every rank on GPU 0 (gloo, as for any ranks sharing a GPU).
    """
    from glm_fused.launcher import launch

    with tempfile.TemporaryDirectory(prefix="glm_fused_bench_") as tmp:
        code = launch(worker, dict(args, result_dir=tmp), nprocs=nprocs, device=device, timeout=timeout,
                      num_gpus=num_gpus)
        reports = {r: report for r in range(nprocs) if (report := read_json(Path(tmp) / f"rank{r}.json"))}
    return code, reports


class BenchRank:
    """One rank of a ``launch_ranks`` job: its place in the process group (joined by the
    backend's own ``init_distributed``, as the package's ranks join), a few collectives, and its
    report, rewritten on every ``save`` so that a later hang loses nothing.

    With the torch backend it also knows its device and holds the TP group's ``TPComm``.
    """

    def __init__(self, args, backend: str = "torch"):
        from glm_fused.backends import get_backend

        self.args = args
        fields = args if isinstance(args, dict) else vars(args)
        self.backend = get_backend(backend)
        self.rank, self.world = self.backend.init_distributed()
        self.report: dict = {}
        self._path = Path(fields["result_dir"]) / f"rank{self.rank}.json"
        if backend == "torch":
            import torch

            from glm_fused.torch_backend import dist

            self.torch = torch
            self.device = dist.device()
            self.on_gpu = self.device.type == "cuda"
            self.shares_gpu = dist.shares_gpu()
            self.dist_backend = dist.dist_backend()
            self.comm = dist.TPComm(self.rank, self.world)

    def save(self, **values) -> None:
        self.report.update(values)
        write_json(self._path, self.report, indent=None)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[tp {self.world}] {text}", flush=True)

    def barrier(self) -> None:
        self.backend.barrier()

    # torch ranks
    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (small Python objects)."""
        return [obj] if self.world == 1 else self.comm.all_gather_object(obj)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        if self.world == 1:
            return int(value)
        import torch.distributed as dist

        t = self.torch.tensor([int(value)], dtype=self.torch.int64,
                              device=self.device if self.dist_backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)
