"""scripts/bench_fusion.py: the cap arithmetic on synthetic timings, and the whole pipeline on
CPU ranks (``--dry-run``: gloo, the reference maths standing in for the kernel, tiny sizes).

The GPU run itself (FlashInfer kernel, NCCL, CUDA graphs) needs several GPUs; docs/multi-gpu.md
says how it is launched. What can be checked here: that the crossover and cap rules do what
they say, that a printed cap row pasted into glm_fused/fused_op/policy.py gives back the measured cap
through the policy code, and that one TP 2 job runs all three sections and reports them.
"""

from __future__ import annotations

import json
import math

import pytest

from glm_fused.fused_op import policy as fusion
from bench import bench_fusion as bf
from bench.common import load_config, token_counts
from glm_fused.errors import UserError

MiB = 1 << 20
H = 4096


def rows_from(times: dict[int, tuple]) -> list[dict]:
    """{tokens: (one-shot, two-shot, unfused torch, unfused FI norm)} in microseconds; None = not timed."""
    keys = ("fused_oneshot", "fused_twoshot", "unfused_torch", "unfused_fi_norm")
    return [{"tokens": n, **dict(zip(keys, t))} for n, t in times.items()]


# ---- crossover: where fused stops winning ---------------------------------------------

def test_crossover_takes_best_of_each_side_and_stops_at_first_loss():
    rows = rows_from({
        1: (10.0, None, 20.0, 15.0),    # 10 vs 15 -> 0.667 win
        3: (11.0, 30.0, 20.0, 16.0),    # 11 vs 16 -> win
        16: (14.0, 13.0, 22.0, 17.0),   # two-shot 13 vs 17 -> win
        64: (25.0, 19.0, 26.0, 20.0),   # 19 vs 20 -> 0.95 win
        128: (40.0, 30.0, 35.0, 25.0),  # 30 vs 25 -> 1.2 loss
        256: (80.0, 60.0, 50.0, 40.0),  # 1.5 loss
    })
    c = bf.crossover(rows)
    assert c["cap_tokens"] == 64
    assert c["first_loss_tokens"] == 128
    assert not c["open_ended"] and c["wins_after_loss"] == []
    by_n = {r["tokens"]: r for r in c["rows"]}
    assert by_n[16]["fused_variant"] == "fused_twoshot" and by_n[16]["unfused_variant"] == "unfused_fi_norm"
    assert by_n[64]["ratio"] == pytest.approx(19 / 20)
    # log-linear interpolation between (64, 0.95) and (128, 1.2), where the ratio crosses 1
    x = math.log(64) + (math.log(128) - math.log(64)) * (-math.log(0.95)) / (math.log(1.2) - math.log(0.95))
    assert c["crossover_estimate"] == round(math.exp(x))
    assert 64 < c["crossover_estimate"] < 128


def test_crossover_never_and_always():
    never = bf.crossover(rows_from({1: (30.0, None, 20.0, None), 16: (10.0, 9.0, 20.0, None)}))
    assert never["cap_tokens"] == 0 and never["first_loss_tokens"] == 1
    assert never["wins_after_loss"] == [16]  # a win past the first loss cannot be used by one cap
    always = bf.crossover(rows_from({1: (5.0, None, 20.0, None), 2048: (50.0, 40.0, 60.0, None)}))
    assert always["cap_tokens"] == 2048 and always["open_ended"] and always["first_loss_tokens"] is None
    assert always["crossover_estimate"] is None


def test_crossover_win_ratio_is_a_margin():
    rows = rows_from({1: (9.8, None, 10.0, None), 8: (9.0, None, 10.0, None)})
    assert bf.crossover(rows)["cap_tokens"] == 8
    assert bf.crossover(rows, win_ratio=0.95)["cap_tokens"] == 0  # 2 % faster is not 5 % faster
    assert bf.crossover(rows, win_ratio=0.95)["wins_after_loss"] == [8]


def test_oneshot_limit_counts_only_sizes_where_two_shot_runs():
    rows = rows_from({1: (5.0, None, 9.0, None), 4: (6.0, None, 9.0, None), 5: (6.0, 8.0, 9.0, None),
                      64: (9.0, 10.0, 12.0, None), 128: (15.0, 11.0, 14.0, None)})
    one = bf.oneshot_limit(rows, tp=4)
    assert one["limit_tokens"] == 64 and one["first_loss_tokens"] == 128
    assert [r["tokens"] for r in one["rows"]] == [5, 64, 128]


def test_fused_by_rule_follows_the_policy_algorithm():
    row = {"tokens": 512, "fused_oneshot": 30.0, "fused_twoshot": 20.0}
    # sm90 TP4 one-shot limit is 2 MiB = 256 tokens at H 4096: 512 tokens is two-shot today
    assert not fusion.use_oneshot(4, 512, H, 2, sm=90)
    assert bf.fused_by_rule(row, 4, H, 90) == 20.0
    assert bf.fused_by_rule({**row, "tokens": 64}, 4, H, 90) == 30.0


# ---- the paste-ready rows -------------------------------------------------------------

def test_bytes_expr():
    assert bf.bytes_expr(2 * MiB) == "2 * MiB"
    assert bf.bytes_expr(MiB // 2) == "MiB // 2"
    assert bf.bytes_expr(129 * H * 2) == str(129 * H * 2)
    assert bf.bytes_expr(0) == "0"


def _parse_row(row: str) -> dict:
    """A printed table row, evaluated the way Python reads it inside fusion.py's dict."""
    body = row.split("#", 1)[0].strip().rstrip(",")
    return eval("{" + body + "}", {"MiB": MiB})  # noqa: S307 - our own output, a dict literal


def test_pasted_cap_row_gives_back_the_measured_caps(monkeypatch):
    timing = {
        2: {"rows": rows_from({1: (5.0, None, 9.0, 8.0), 1024: (40.0, 30.0, 45.0, 35.0),
                               2048: (80.0, 55.0, 70.0, 50.0)})},                         # cap 1024
        4: {"rows": rows_from({1: (5.0, None, 9.0, 8.0), 129: (9.0, 12.0, 10.0, 9.5),
                               256: (15.0, 14.0, 13.0, 12.0)})},                          # cap 129
        8: {"rows": rows_from({1: (9.0, None, 9.0, 8.0), 64: (9.0, 12.0, 10.0, 9.5)})},   # never
    }
    code = {tp: fusion.size_cap_tokens(90, tp, H, 2) for tp in (2, 4, 8)}
    caps = bf.caps_from_timing(timing, 90, H, code_caps=code, when="2026-12-03", where="8x NVIDIA H200")
    assert caps["caps_tokens"] == {2: 1024, 4: 129, 8: 0}
    assert caps["oneshot_tokens"] == {2: 0, 4: 129, 8: 64}
    assert "tp8 never fused (slower already at 1 tokens)" in caps["notes"]
    row = caps["size_cap_row"]
    assert row.startswith("    90: {") and "# 8x NVIDIA H200, 2026-12-03" in row
    parsed = _parse_row(row)
    assert parsed == {90: {2: 8 * MiB, 4: 129 * H * 2, 8: 0}}
    # Pasted into fusion.py, the policy answers with exactly the measured caps.
    monkeypatch.setitem(fusion._SIZE_CAP_BYTES, 90, parsed[90])
    env = lambda tp: fusion.KernelEnv("cuda", 90, tp, H, None, 2048)  # noqa: E731
    assert [fusion.size_cap_tokens(90, tp, H, 2) for tp in (2, 4, 8)] == [1024, 129, 0]
    assert fusion.choose_impl(env(4), dtype="bf16", num_tokens=129) == ("flashinfer", None)
    assert fusion.choose_impl(env(4), dtype="bf16", num_tokens=130)[0] == "reference"
    assert fusion.choose_impl(env(8), dtype="bf16", num_tokens=1)[0] == "reference"
    assert fusion.workspace_tokens(90, 2, H, 2, 2048) == 1024
    one = _parse_row(caps["oneshot_row"])
    assert one == {90: {2: 0, 4: 129 * H * 2, 8: MiB // 2}}
    monkeypatch.setitem(fusion._ONESHOT_MAX_BYTES, 90, one[90])
    assert fusion.use_oneshot(4, 129, H, 2, sm=90) and not fusion.use_oneshot(4, 130, H, 2, sm=90)
    assert fusion.use_oneshot(2, 2, H, 2, sm=90) and not fusion.use_oneshot(2, 3, H, 2, sm=90)


def test_unmeasured_tp_keeps_the_code_cap():
    timing = {4: {"rows": rows_from({1: (5.0, None, 9.0, None), 256: (9.0, 8.0, 10.0, None)})}}
    caps = bf.caps_from_timing(timing, 90, H, code_caps={2: 8192, 4: 256, 8: 64}, when="d", where="4x H200")
    assert _parse_row(caps["size_cap_row"]) == {90: {2: 64 * MiB, 4: 2 * MiB, 8: MiB // 2}}
    assert "tp2, tp8 not measured, kept from the code" in caps["size_cap_row"]
    assert "tp4 fused faster at every size measured (<= 256 tokens)" in caps["notes"]


# ---- report and verdict ---------------------------------------------------------------

def _args(**kw):
    import argparse

    base = dict(hidden=H, gpus=8, device="gpu", stand_in=False, win_ratio=1.0)
    return argparse.Namespace(**{**base, **kw})


def test_report_fails_on_a_failed_check_or_an_unfinished_job():
    good_check = {"passed": True, "rows": [{"tokens": 1, "modes": ["oneshot"], "normed_rel": 5e-3,
                                            "residual_rel": 4e-3, "nan": False, "ranks_agree": True,
                                            "pass": True}]}
    bad_check = {"passed": False, "rows": [dict(good_check["rows"][0], normed_rel=0.5, **{"pass": False})]}
    results = {2: {"status": "done", "sm": 90, "check": good_check},
               4: {"status": "done", "sm": 90, "check": bad_check},
               8: {"status": "timeout", "sm": 90}}
    report = bf.build_report(_args(), {"gpu": "NVIDIA H200"}, results)
    assert not report["passed"]
    assert report["failures"] == ["tp 4: kernel check failed", "tp 8: job timeout"]
    text = bf.render_report(report)
    assert "| 4 | 1 | oneshot | 5.0e-01 |" in text and "FAIL: tp 4: kernel check failed" in text
    ok = bf.build_report(_args(), {"gpu": "NVIDIA H200"}, {2: results[2]})
    assert ok["passed"] and ok["where"] == "8x NVIDIA H200"


def test_compare_layouts_judges_pooled_rows():
    import numpy as np

    rng = np.random.default_rng(0)
    base = {k: rng.normal(size=(n, 50)).astype(np.float32) for k, n in (("a", 30), ("b", 1))}
    same = bf.compare_layouts(base, {k: v.copy() for k, v in base.items()}, {"a": "A", "b": "B"},
                              tolerance=0.05, min_top1=0.9)
    assert same["passed"] and same["rows"][-1]["positions"] == 31 and same["rows"][0]["pass"] is None
    # One row of 31 whose top two sit 1e-3 apart flipping its top-1 does not fail the run ...
    second, first = base["b"][0].argsort()[-2:]
    base["b"][0, second] = base["b"][0, first] - 1e-3
    flipped = {k: v.copy() for k, v in base.items()}
    flipped["b"][0, second] = base["b"][0, first] + 1e-3
    res = bf.compare_layouts(base, flipped, {"a": "A", "b": "B"}, tolerance=0.05, min_top1=0.9)
    assert res["rows"][1]["top1_agreement"] == 0.0 and res["passed"]
    # ... a large difference does, and so does a NaN.
    far = {k: v * 1.2 for k, v in base.items()}
    assert not bf.compare_layouts(base, far, {"a": "A", "b": "B"}, tolerance=0.05, min_top1=0.9)["passed"]
    nan = {k: v.copy() for k, v in base.items()}
    nan["a"][3, 3] = np.nan
    assert not bf.compare_layouts(base, nan, {"a": "A", "b": "B"}, tolerance=0.05, min_top1=0.9)["passed"]


# ---- sizing the model -----------------------------------------------------------------

def test_layer_budget_counts_weights_and_kv_cache():
    from glm_fused.config import Glm4MoeConfig
    from glm_fused.tiny import configs_dir

    config = Glm4MoeConfig.from_json_file(configs_dir() / "glm-4.5-air.json")
    GiB = 1 << 30
    kw = dict(dtype_bytes=2, kv_slots=64, max_len=2048, reserve_bytes=8 * GiB)
    # GLM-4.5-Air at TP 2: ~2.3 GB of weights per MoE layer per rank; all 46 fit in 0.9 of an H200.
    assert bf.layer_budget(config, 2, 0, free_bytes=int(0.9 * 139 * GiB), **kw) == 46
    # An independent count for TP 4: one MoE layer's bf16 weights on a rank, router fp32, plus its KV cache.
    E, Hd, Im, D = 128, 4096, 1408 // 4, 128
    moe = (E * 3 * Im * Hd + 3 * Im * Hd + (24 + 2 * 2) * D * Hd + (24 + 2 * 2) * D + Hd * 24 * D + 2 * Hd) * 2 \
        + (E * Hd + E) * 4
    kv = 2 * 64 * 2048 * 2 * D * 2
    dense = (2 * (10944 // 4) * Hd + Hd * (10944 // 4) + (24 + 4) * D * Hd + (24 + 4) * D + Hd * 24 * D + 2 * Hd) * 2
    fixed = 2 * (151552 // 4) * Hd * 2 + Hd * 2  # embedding + lm_head rows, final norm
    free = kw["reserve_bytes"] + fixed + dense + kv + 10 * (moe + kv) + 1
    assert bf.layer_budget(config, 4, 1, free_bytes=free, **kw) == 11
    assert bf.layer_budget(config, 4, 1, free_bytes=free - 2, **kw) == 10
    assert bf.layer_budget(config, 4, 1, free_bytes=GiB, **kw) == 0


def test_load_config_overrides_layers():
    from glm_fused.tiny import configs_dir

    path = configs_dir() / "glm-4.5-air.json"
    c = load_config(path, 12)
    assert c.num_hidden_layers == 12 and c.hidden_size == 4096 and c.n_routed_experts == 128
    assert load_config(path, 1).first_k_dense_replace == 1


# ---- flags ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--dry-run", "--only", "check,bogus"], "--only check,bogus"),
    (["--dry-run", "--model-variants", "fused,x"], "--model-variants"),
    (["--dry-run", "--tp", "3"], "not a TP size the TRT-LLM kernel is built for"),
    (["--dry-run", "--tp", "1"], "needs TP >= 2"),
    (["--dry-run", "--num-layers", "0"], "--num-layers 0"),
    (["--dry-run", "--hidden", "100"], "multiple of 8"),
    (["--dry-run", "--device", "gpu"], "drop --device gpu"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    args = bf.build_parser().parse_args(argv)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("+", r"\+")):
        bf.prepare(args)


def test_tp_sizes_past_the_visible_gpus_are_skipped(monkeypatch):
    monkeypatch.setattr(bf, "_visible_gpus", lambda: 4)
    args = bf.prepare(bf.build_parser().parse_args(["--tp", "2,4,8", "--only", "check,timing"]))
    assert args.run_tps == [2, 4] and "needs 8 GPUs, 4 visible" in args.skipped_tps["8"]
    assert args.hidden == 4096 and args.workspace_tokens == 2048 and args.replays == 200
    assert token_counts(4, args.workspace_tokens, args.tokens) == [1, 3, 5, 16, 64, 128, 129, 256, 512, 1024, 2048]
    shared = bf.prepare(bf.build_parser().parse_args(["--tp", "8", "--shared-gpu", "--only", "check"]))
    assert shared.run_tps == [8]
    monkeypatch.setattr(bf, "_visible_gpus", lambda: 0)
    with pytest.raises(UserError, match="no GPU visible"):
        bf.prepare(bf.build_parser().parse_args(["--tp", "2"]))


# ---- the whole pipeline on CPU ranks --------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dry_run_tp2_runs_every_section(tmp_path, capsys, monkeypatch):
    for key in bf.NO_MULTICAST_ENV:
        monkeypatch.delenv(key, raising=False)  # main() must set them for the ranks itself
    code = bf.main(["--dry-run", "--tp", "2", "--dtype", "float32", "--timeout", "90", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads((tmp_path / "bench_fusion.json").read_text())
    md = (tmp_path / "bench_fusion.md").read_text()
    job = report["tp"]["2"]
    assert report["passed"] and job["status"] == "done" and job["dist_backend"] == "gloo"
    assert job["env"] == bf.NO_MULTICAST_ENV  # what the ranks saw

    # (a): tokens 1, tp-1 (= 1), tp+1, 16 at hidden 128; stand-in = fp32 sum rounded once to bf16
    check = job["check"]
    assert check["stand_in"] and check["passed"]
    assert [r["tokens"] for r in check["rows"]] == [1, 3, 16]
    assert check["rows"][1]["modes"] == ["oneshot", "twoshot", "auto-inplace"]
    for r in check["rows"]:
        assert r["ranks_agree"] and not r["nan"]
        assert 0 < r["normed_rel"] <= 1e-2 and 0 < r["residual_rel"] <= 1e-2     # bf16 output rounding
        assert 0 < r["unfused_normed_rel"] <= 2e-2                                # bf16 all-reduce + add
        assert r["nccl_vs_local"] <= 1e-6

    # (b): every variant that exists on CPU timed, by both ranks; rows feed the cap computation
    timing = job["timing"]
    for r in timing["rows"]:
        assert r["fused_oneshot"] > 0 and r["unfused_torch"] > 0 and r["unfused_fi_norm"] is None
        assert (r["fused_twoshot"] is None) == (r["tokens"] <= 2)
        assert len(r["fused_oneshot_ranks"]) == 2 and r["fused_oneshot"] == max(r["fused_oneshot_ranks"])
    caps = report["caps"]
    assert set(caps["caps_tokens"]) == {"2"} and caps["size_cap_row"].startswith("    cpu: {")
    assert "DRY RUN, not a measurement" in caps["size_cap_row"]

    # (c): both layouts of the tiny model, same weights and inputs; fp32 -> same maths up to
    # the order of additions (1e-5 of the largest logit, as tests/test_torch_model.py)
    model = job["model"]
    assert model["num_layers"] == 4 and model["variants"] == ["unfused", "fused"]
    for variant in ("unfused", "fused"):
        t = model["timing"][variant]
        for key in ("prefill", "decode_b1", "decode_b4"):
            assert t[key]["median_ms"] > 0 and len(t[key]["rank_medians_ms"]) == 2
    fused = model["timing"]["fused"]["decode_b4"]
    assert fused["fused_calls"] == 2 * 4 + 1 and fused["plain_allreduce_calls"] == 0
    assert model["timing"]["unfused"]["decode_b4"]["plain_allreduce_calls"] == 2 * 4 + 1
    parity = model["parity"]
    assert parity["passed"] and [r["key"] for r in parity["rows"]] == ["prompt", "prefill", "decode_b1",
                                                                       "decode_b4", "all"]
    assert parity["rows"][-1]["positions"] == 12 + 1 + 1 + 4
    assert all(r["max_rel_diff"] <= 1e-5 and r["top1_agreement"] == 1.0 for r in parity["rows"])

    # The printed report is the Markdown file.
    for heading in ("### (a)", "### (b) TP 2", "### (c) model", "### (c) logit parity", "**PASS**"):
        assert heading in md and heading in text
