"""Rank-side code for tests/test_model.py: one backend's model on N ranks (CPU, or GPU ranks).

One multi-rank run does every check for its (backend, TP size): starting ranks costs seconds
on two cores. Each rank runs the same scenarios through ``ModelRunner`` in fused and classic
layout for every checkpoint, compares, and writes ``rank{r}.json`` (+ logits ``.npz`` on rank
0); the test asserts on those files. Only the backend-independent API is used (``EngineArgs``,
``ModelRunner``, ``get_backend(name).Glm4MoeForCausalLM``), so both frameworks run the same code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glm_fused.batch import ForwardBatch  # noqa: E402
from glm_fused.engine_args import EngineArgs  # noqa: E402

MAX_SEQS, MAX_LEN, MAX_TOKENS = 4, 64, 64


def rel_err(test: np.ndarray, ref: np.ndarray) -> float:
    """max |test - ref| / max |ref|."""
    return float(np.abs(np.asarray(test, np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def compare(test: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Differences relative to the reference's scale (max |ref|): ``max`` and ``mean`` |diff|,
    ``p90`` the 90th percentile over rows of a row's max |diff|; ``top1`` argmax agreement."""
    test, ref = np.asarray(test, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.abs(ref).max()), 1e-30)
    rows = np.abs(test - ref).reshape(-1, ref.shape[-1]).max(axis=-1) / scale
    return {"max": float(rows.max()), "mean": float(np.abs(test - ref).mean() / scale),
            "p90": float(np.percentile(rows, 90)), "top1": float(np.mean(test.argmax(-1) == ref.argmax(-1)))}


def compare_all(tests: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per scenario, plus ``all``: every row of every scenario pooled (for bf16, where a few
    rows flip an expert choice under rounding and a 1-row scenario says little on its own)."""
    table = {k: compare(v, refs[k]) for k, v in tests.items()}
    table["all"] = compare(np.concatenate([tests[k] for k in tests]), np.concatenate([refs[k] for k in tests]))
    return table


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in arrays)).hexdigest()


def engine_args(ckpt, world: int, **overrides) -> EngineArgs:
    values = dict(model=str(ckpt), tp=world, backend="torch", device="cpu", dtype="float32",
                  max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_TOKENS, block_size=8)
    values.update(overrides)
    args = EngineArgs(**values).resolve()
    args.num_gpu_blocks_override = args.slot_blocks()  # one slot of MAX_LEN positions per sequence
    return args


def scattered(runner, slots) -> np.ndarray:
    """Block tables of fixed slots, each slot's blocks scattered over the cache by one fixed
    permutation: a sequence's pages are out of order and apart, as a busy cache leaves them."""
    perm = np.random.default_rng(0).permutation(runner.args.num_kv_blocks)
    return perm[runner.slot_tables(slots)]


def run_scenarios(runner, prompts: list[list[int]]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Logits of each scenario, each laid out to compare with the full-prompt references.

    ``prompts[0]`` has 40 tokens, ``prompts[1]`` has 7. Each sequence gets the blocks of a
    fixed slot, scattered over the cache (``scattered``). Slots are reused: every scenario
    starts its sequences at position 0, overwriting what an earlier one cached.
    """
    p0, p1 = prompts[0], prompts[1]
    stats: list[dict] = []
    out: dict[str, np.ndarray] = {}

    def step(batch: ForwardBatch) -> np.ndarray:
        logits = runner.forward(batch)
        stats.append(runner.fusion_stats())
        return logits

    def prefill(ps, slots=None):
        return step(ForwardBatch.prefill(ps, scattered(runner, slots or range(len(ps))), all_logits=True))

    # Whole prompts in one batch (two sequences, 47 tokens); and token counts 1, 3 (< TP 4), 40.
    out["prefill_2seq"] = prefill([p0, p1])
    out["tokens_1"] = prefill([p0[:1]])
    out["tokens_3"] = prefill([p0[:3]])
    out["tokens_40"] = prefill([p0])

    # KV cache: prefill 20, chunked prefill of 10 more after cached context, then 10 decode steps.
    rows = [prefill([p0[:20]], slots=[1])]
    rows.append(step(ForwardBatch(p0[20:30], np.arange(20, 30), [10], [20], np.arange(10), scattered(runner, [1]))))
    for t in range(30, 40):
        rows.append(step(ForwardBatch.decode([p0[t]], [t], scattered(runner, [1]))))
    out["cached_decode"] = np.concatenate(rows)  # rows of positions 0..39 of p0

    # Mixed batch: sequence A decodes its last token while sequence B prefills its whole prompt.
    step(ForwardBatch.prefill([p0[:39]], scattered(runner, [0])))
    mixed = ForwardBatch(np.array([p0[39], *p1]), np.array([39, *range(len(p1))]), [1, len(p1)], [39, 0],
                         np.arange(1 + len(p1)), scattered(runner, [0, 2]))
    out["mixed"] = step(mixed)  # row 0: p0 position 39; rows 1..: p1

    # Batched decode of two sequences with different context lengths.
    step(ForwardBatch.prefill([p0[:35], p1[:5]], scattered(runner, [3, 0])))
    steps = [step(ForwardBatch.decode([p0[35 + i], p1[5 + i]], [35 + i, 5 + i], scattered(runner, [3, 0])))
             for i in range(2)]
    out["batched_decode"] = np.concatenate(steps)  # p0@35, p1@5, p0@36, p1@6
    return out, stats


def references(ref0: np.ndarray, ref1: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of the full-prompt references each scenario should reproduce (causal: a
    prefix's logits are the first rows of the whole prompt's)."""
    return {
        "prefill_2seq": np.concatenate([ref0, ref1]),
        "tokens_1": ref0[:1],
        "tokens_3": ref0[:3],
        "tokens_40": ref0,
        "cached_decode": ref0,
        "mixed": np.concatenate([ref0[39:40], ref1]),
        "batched_decode": np.stack([ref0[35], ref1[5], ref0[36], ref1[6]]),
    }


def self_consistency(out: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Cached and batched paths against this runner's own one-shot forward of the same tokens."""
    full0, full1 = out["tokens_40"], out["prefill_2seq"][40:]
    keys = ("cached_decode", "mixed", "batched_decode", "prefill_2seq")
    return compare_all({k: out[k] if k != "prefill_2seq" else out[k][:40] for k in keys}, {
        "cached_decode": full0,
        "mixed": np.concatenate([full0[39:40], full1]),
        "batched_decode": np.stack([full0[35], full1[5], full0[36], full1[6]]),
        "prefill_2seq": full0,
    })


def tp_checks(args: dict) -> None:
    """Every multi-rank check for one (backend, TP size); results to ``args['out']/rank{r}.json``.

    ``args``: ``out``, ``backend``, ``prompts``, ``checkpoints`` (name -> directory holding
    ``hf_logits_{0,1}.npy``), optionally ``device`` (cpu), ``dtype`` (float32) and ``extras``
    (True: also the once-per-launch checks below, on the first checkpoint).
    """
    from glm_fused.backends import get_backend
    from glm_fused.fused_op import FallbackLog
    from glm_fused.runner import ModelRunner

    name_of_backend = args["backend"]
    backend = get_backend(name_of_backend)
    rank, world = backend.init_distributed()
    FallbackLog.reset()  # TP 1 runs inside the test process: start from a fresh process's state
    log: list[str] = []  # every log record of this rank, to count the fallback messages
    handler = _ListHandler(log)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    out_dir = Path(args["out"])
    prompts = args["prompts"]
    common = dict(backend=name_of_backend, device=args.get("device", "cpu"), dtype=args.get("dtype", "float32"))
    result: dict = {"rank": rank, "world": world, "checkpoints": {}}
    saved: dict[str, np.ndarray] = {}
    for name, ckpt in args["checkpoints"].items():
        refs = references(np.load(Path(ckpt) / "hf_logits_0.npy"), np.load(Path(ckpt) / "hf_logits_1.npy"))
        logits, entry = {}, {"vs_hf": {}, "self": {}, "stats": {}, "digest": {}}
        for fused in (True, False):
            mode = "fused" if fused else "unfused"
            ea = engine_args(ckpt, world, fused=fused, **common)
            runner = ModelRunner(ea, ea.config(), tp_rank=rank, tp_size=world)
            result["device"] = str(runner.device)
            logits[mode], stats = run_scenarios(runner, prompts)
            runner.close()
            entry["vs_hf"][mode] = compare_all(logits[mode], refs)
            entry["self"][mode] = self_consistency(logits[mode])
            entry["stats"][mode] = stats
            # Every rank must hold the same full-vocab logits: compare digests across ranks.
            entry["digest"][mode] = digest(*(v for _, v in sorted(logits[mode].items())))
            for key, value in logits[mode].items():
                saved[f"{name}.{mode}.{key}"] = value
        entry["fused_vs_unfused"] = compare_all(logits["fused"], logits["unfused"])
        entry["num_layers"] = ea.config().num_hidden_layers
        result["checkpoints"][name] = entry
    if args.get("extras"):
        result.update(_extras(args, backend, rank, world, common, log))
    result["log"] = log
    logging.getLogger().removeHandler(handler)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        np.savez(out_dir / "logits.npz", **saved)


def _extras(args: dict, backend, rank: int, world: int, common: dict, log: list[str]) -> dict:
    """Once per launch, on the first checkpoint: the forced kernel on CPU, the model class on
    its own, dummy weights, the backend module's collectives."""
    from glm_fused.runner import ModelRunner

    out: dict = {}
    name, ckpt = next(iter(args["checkpoints"].items()))
    p0, p1 = args["prompts"]
    hf0, hf1 = np.load(Path(ckpt) / "hf_logits_0.npy"), np.load(Path(ckpt) / "hf_logits_1.npy")

    # FlashInfer asked for by an API user on CPU (the command line refuses it): every call
    # falls back, and the runner says why once.
    start = len(log)
    ea = engine_args(ckpt, world, **common)
    ea.fusion_impl = "flashinfer"
    runner = ModelRunner(ea, ea.config(), tp_rank=rank, tp_size=world)
    stats = []
    forced = runner.forward(ForwardBatch.prefill([p0[:5]], runner.slot_tables([0]), all_logits=True))
    stats.append(runner.fusion_stats())
    runner.forward(ForwardBatch.decode([p0[5]], [5], runner.slot_tables([0])))
    stats.append(runner.fusion_stats())
    runner.close()
    out["forced_flashinfer"] = {"stats": stats, "vs_hf": rel_err(forced, hf0[:5]), "log": log[start:]}

    # The model on its own: from_pretrained + model(ids) on a [batch, seq] array and a [seq] list.
    model = backend.Glm4MoeForCausalLM.from_pretrained(ckpt, tp_rank=rank, tp_size=world, fused=True)
    F = model.F
    batch_logits = F.to_numpy(model(np.array([p0[:7], p1])))
    seq_logits = F.to_numpy(model(p1))
    out["standalone"] = {"shape_2d": list(batch_logits.shape), "shape_1d": list(seq_logits.shape),
                         "vs_hf_2d": rel_err(batch_logits, np.stack([hf0[:7], hf1])),
                         "vs_hf_1d": rel_err(seq_logits, hf1)}

    # A tp_size other than the job's size is refused by name, before any collective.
    try:
        backend.Glm4MoeForCausalLM(model.config, tp_rank=rank % 2, tp_size=4 if world == 2 else 2)
        out["wrong_tp_size"] = None
    except ValueError as exc:
        out["wrong_tp_size"] = str(exc)

    # Dummy weights: deterministic, and the replicated router is the same on every rank.
    dummy = []
    for _ in range(2):
        ea = engine_args(ckpt, world, load_format="dummy", seed=7, max_num_seqs=1, max_model_len=16,
                         max_num_batched_tokens=16, **common)
        r = ModelRunner(ea, ea.config(), tp_rank=rank, tp_size=world)
        dummy.append(r.forward(ForwardBatch.prefill([p0[:4]], r.slot_tables([0]))))
        params = {k: F.to_numpy(F.float32(v)) for k, v in r.model.named_parameters()}
        r.close()
    routers = [params[k] for k in sorted(params) if ".mlp.gate." in k]
    out["dummy"] = {"repeat_equal": bool(np.array_equal(dummy[0], dummy[1])),
                    "finite": bool(np.isfinite(dummy[0]).all()), "router_digest": digest(*routers),
                    "weight_digest": digest(params["layers.0.self_attn.qkv_proj.weight"]),
                    "norm_all_ones": bool((params["norm.weight"] == 1).all()), "logits_std": float(dummy[0].std()),
                    "qkv_std": float(params["layers.0.self_attn.qkv_proj.weight"].std())}

    # The backend module's collectives.
    sent = np.arange(6, dtype=np.int64) * 7 if rank == 0 else None
    out["broadcast"] = backend.broadcast_int64(sent, src=0).tolist()
    backend.barrier()
    return out


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]):
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())
