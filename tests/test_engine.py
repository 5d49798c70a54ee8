"""Engine, scheduler, sequence and sampler against a fake runner (in-process, fast).

The fake runner keeps a real paged token cache, written and read through the batch's block
tables, and derives each position's logits from a hash of every token the cache holds for
that sequence up to it, so a scheduling or block-bookkeeping mistake (wrong block, a block
shared while being written, stale cached content, wrong context, a chunk out of order)
changes the generated tokens and fails a test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import queue
import random
import threading
import time

import numpy as np
import pytest

from glm_fused.batch import ForwardBatch
from glm_fused.engine import InvalidParam, LLMEngine, SamplingParams, Scheduler, Sequence, run_worker, sample
from glm_fused.engine.llm_engine import CMD_NOOP, CMD_PING
from glm_fused.engine.sampling import SampleRow, SamplingBatch, logprobs_on_host, row_key
from glm_fused.engine_args import EngineArgs
from glm_fused.runner import StepOutput, StepResult

VOCAB = 64
BLOCK = 4  # small blocks: short test prompts still span several


class _HostClock:
    @staticmethod
    def elapsed(start: float, end: float) -> float:
        return end - start


class FakeRunner:
    """A stand-in for ``ModelRunner``: ``forward`` gives logits as a host array, and ``execute``
    resolves the placeholders from its own record of what it sampled and samples on the host."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK, vocab: int = VOCAB):
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.block_size, self.vocab = block_size, vocab
        self.batches: list[ForwardBatch] = []
        self.step_seconds: list[float] = []
        self._last_sampled: dict[int, int] = {}

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch | None = None, *, sample: bool = True):
        sampling = sampling if sampling is not None else SamplingBatch()
        last = self._last_sampled
        if (batch.input_ids < 0).any():
            rows = np.repeat(batch.rows, batch.query_lens)
            ids = np.array([last[int(r)] if t < 0 else t for t, r in zip(batch.input_ids, rows)])
            batch = dataclasses.replace(batch, input_ids=ids)
        P = len(sampling.prompt_rows)
        start = time.perf_counter()
        if not sample and not P:
            self.forward(batch)
            self.step_seconds.append(time.perf_counter() - start)
            return StepResult(lambda: None, (start, start + self.step_seconds[-1]), _HostClock)
        rows = np.concatenate([sampling.prompt_rows, batch.logits_indices if sample else sampling.prompt_rows[:0]])
        logits = self.forward(dataclasses.replace(batch, logits_indices=rows))
        self.step_seconds.append(time.perf_counter() - start)  # the "device time" of a step: the fake's forward
        marks = (start, start + self.step_seconds[-1])
        out = StepOutput(None)
        if sample:
            out.tokens = sampling.sample_on_host(logits[P:])
            last.update(zip(batch.rows[batch.logits_seq].tolist(), out.tokens.tolist()))
            if sampling.logprobs >= 0:
                out.logprobs = logprobs_on_host(logits[P:], out.tokens, sampling.logprobs)
        if P:
            out.prompt_logprobs = logprobs_on_host(logits[:P], sampling.prompt_targets, sampling.prompt_logprobs)
        return StepResult(lambda: out, marks, _HostClock)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        self.batches.append(batch)
        size = self.block_size
        written = set()
        rows = {}
        for s, start in enumerate(batch.seq_starts):
            table, ctx, q = batch.block_tables[s], int(batch.context_lens[s]), int(batch.query_lens[s])
            pos = batch.positions[start:start + q]
            assert list(pos) == list(range(ctx, ctx + q)), "positions do not follow the context"
            for p, token in zip(pos, batch.input_ids[start:start + q]):
                where = (int(table[p // size]), int(p % size))
                assert where not in written, "two sequences write one cache position in one step"
                written.add(where)
                self.cache[where] = token
            tokens = self.cache[table[np.arange(ctx + q) // size], np.arange(ctx + q) % size]
            assert (tokens >= 0).all(), "context not in the cache"
            for i in range(q):
                rows[int(start) + i] = self._logits(tokens[:ctx + i + 1])
        return np.stack([rows[int(i)] for i in batch.logits_indices]).astype(np.float32)

    def _logits(self, tokens: np.ndarray) -> np.ndarray:
        digest = hashlib.sha256(tokens.tobytes()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(self.vocab)


def settings(max_num_seqs: int, max_model_len: int, budget: int, num_blocks: int | None = None,
             prefix_caching: bool = True) -> EngineArgs:
    args = EngineArgs(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      block_size=BLOCK, enable_prefix_caching=prefix_caching)
    args.num_kv_blocks = num_blocks or args.slot_blocks()  # as a runner would set it
    return args


def make_engine(max_num_seqs=4, max_model_len=64, budget=16, num_blocks=None, prefix_caching=True, **kwargs):
    args = settings(max_num_seqs, max_model_len, budget, num_blocks, prefix_caching)
    runner = FakeRunner(args.num_kv_blocks)
    engine = LLMEngine(runner, args, vocab_size=VOCAB, **kwargs)
    return engine, runner


PROMPTS = [[1, 2, 3], list(range(5, 30)), [7], list(range(10, 18)), [40, 41, 42, 43, 44], list(range(1, 40))]


def greedy(n=12):
    return SamplingParams(max_tokens=n, temperature=0.0)


# ---- sampler -------------------------------------------------------------------------------
def keys(seed: int, n: int) -> list[int]:
    """The keys of a sequence's first n draws."""
    return [row_key(seed, i) for i in range(n)]


def test_row_key_is_splitmix64_of_seed_and_step():
    """The per-row key in Python ints equals SplitMix64 on uint64 (the uniforms' own form)."""
    from glm_fused.engine.sampling import GOLDEN, splitmix64

    rng = np.random.default_rng(5)
    pairs = [(0, 0), (2**63 - 1, 0), (2**63 - 1, 2**40), (1, 1)] + \
        [(int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32))) for _ in range(2000)]
    for seed, step in pairs:
        with np.errstate(over="ignore"):
            want = int(splitmix64(np.uint64(seed) + np.uint64(GOLDEN) * np.uint64(step + 1)).astype(np.int64))
        assert row_key(seed, step) == want, (seed, step)


def test_greedy_is_argmax_and_top_k_1():
    logits = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    assert sample(logits, greedy(), row_key(1, 0)) == int(np.argmax(logits))
    assert all(sample(logits, SamplingParams(temperature=1.5, top_k=1), k) == int(np.argmax(logits))
               for k in keys(1, 20))


def test_seeded_sampling_reproducible_and_unseeded_varies():
    logits = np.zeros(1000, dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=1234)
    a = [sample(logits, params, row_key(params.sampling_seed(), 0)) for _ in range(3)]
    assert len(set(a)) == 1
    draws = [sample(logits, params, k) for k in keys(params.sampling_seed(), 50)]
    assert len(set(draws)) > 10  # each output index has its own uniforms
    free = SamplingParams(temperature=1.0)
    assert len({sample(logits, free, row_key(free.sampling_seed(), 0)) for _ in range(20)}) > 1


def test_uniforms_are_uniform_and_keyed():
    from glm_fused.engine.sampling import uniforms

    u = uniforms(row_key(5, 0), 200_000)
    assert 0 < u.min() and u.max() < 1
    # mean 1/2 and variance 1/12 within 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / len(u)) ** 0.5
    assert abs(u.var() - 1 / 12) < 5 * (1 / 180 / len(u)) ** 0.5
    assert not np.array_equal(uniforms(row_key(5, 1), 10), uniforms(row_key(5, 0), 10))
    assert not np.array_equal(uniforms(row_key(6, 0), 10), uniforms(row_key(5, 0), 10))


def test_top_k_and_top_p_restrict_the_support():
    logits = np.array([5.0, 4.0, 3.0, 0.0, -1.0, -2.0], dtype=np.float32)
    ks = keys(0, 2000)
    hot = SamplingParams(temperature=50.0, top_k=3)  # nearly uniform over the top 3
    seen = {sample(logits, hot, k) for k in ks[:300]}
    assert seen == {0, 1, 2}
    # softmax(logits) ~ [0.66, 0.24, 0.09, ...]: top_p 0.5 keeps only id 0, 0.8 keeps 0 and 1.
    assert {sample(logits, SamplingParams(top_p=0.5), k) for k in ks[:200]} == {0}
    assert {sample(logits, SamplingParams(top_p=0.8), k) for k in ks[:400]} == {0, 1}
    # Frequencies follow the (renormalised) distribution: id 0 ~ 0.66/0.90 = 0.73 +- 0.05.
    draws = [sample(logits, SamplingParams(top_p=0.8), k) for k in ks]
    assert abs(draws.count(0) / 2000 - 0.66524 / (0.66524 + 0.24473)) < 0.05


def _mixed_rows(vocab: int, n: int = 40, with_rules: bool = True):
    """Rows of every kind: greedy, temperature, top-k, top-p, min_p; with ``with_rules`` also
    penalties over a history, logit_bias, min_tokens, and grammar bitmasks."""
    rng = np.random.default_rng(11)
    rows = []
    kinds = [greedy(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=50, top_p=0.7),
             SamplingParams(temperature=1.1, min_p=0.05)]
    for i in range(n):
        params = kinds[i % len(kinds)]
        row = SampleRow(params, row_key(1000 + i, i))
        if with_rules and i % 4:
            history = rng.integers(0, vocab, size=12).tolist()
            bias = {int(t): float(b) for t, b in zip(rng.integers(0, vocab, 3), rng.uniform(-5, 5, 3))}
            params = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, repetition_penalty=[1.0, 1.3, 0.8][i % 3],
                                    presence_penalty=[0.0, 0.5, -0.7][(i // 3) % 3],
                                    frequency_penalty=[0.4, 0.0, 1.5][(i // 2) % 3], logit_bias=bias,
                                    min_tokens=3 * (i % 2), max_tokens=20)
            mask = None
            if i % 5 == 0:  # a grammar allowing a random third of the vocabulary
                allowed = rng.random(vocab) < 0.33
                allowed[int(rng.integers(vocab))] = True
                mask = np.packbits(np.concatenate([allowed, np.zeros(-vocab % 32, bool)]),
                                   bitorder="little").view("<i4").astype(np.int32)
            row = SampleRow(params, row_key(1000 + i, i), num_output=i % 4, stop_ids=(1, 2, 3),
                            prompt_ids=history[:6], output_ids=history[6:], bitmask=mask)
        rows.append(row)
    return rows


def _torch_device(name: str):
    torch = pytest.importorskip("torch")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch, torch.device(name)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("with_rules", [False, True], ids=["plain", "rules"])
def test_device_sampler_draws_what_the_host_draws(with_rules, device):
    """TorchOps.sample (the device path; on CPU tensors, and on a GPU where there is one)
    against the host reference: the same token for every row, greedy, temperature, top-k,
    top-p, min_p, seeded per row; and with penalties, logit_bias, min_tokens and grammar masks."""
    torch, dev = _torch_device(device)
    from glm_fused.engine.sampling import SamplingBatch
    from glm_fused.torch_backend import OPS

    rng = np.random.default_rng(3)
    logits = (2.0 * rng.standard_normal((40, 300))).astype(np.float32)
    batch = SamplingBatch.build(_mixed_rows(300, with_rules=with_rules))
    host = batch.sample_on_host(logits)
    device = OPS.sample(torch.from_numpy(logits).to(dev), batch).cpu().numpy()
    assert (device == host).all(), np.flatnonzero(device != host)
    assert len(set(host[1::6].tolist())) > 3  # the sampled rows really vary
    # The batch crosses to the other ranks as one int64 array, unchanged.
    back, used = SamplingBatch.from_array(np.concatenate([batch.to_array(), [7, 7]]))
    assert used == len(batch.to_array())
    for name in batch.__dataclass_fields__:
        a, b = getattr(batch, name), getattr(back, name)
        assert np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype, name


def test_the_rules_do_what_they_say():
    """Each rule on hand-made logits (host reference; the device matches it, above)."""
    logits = np.array([[3.0, 2.0, 1.0, -1.0, -2.0]], np.float32)

    def pick(params, **row):
        return int(SamplingBatch.build([SampleRow(params, row_key(0, 0), **row)]).sample_on_host(logits)[0])

    assert pick(greedy()) == 0
    assert pick(SamplingParams(temperature=0, logit_bias={4: 10.0})) == 4
    assert pick(greedy(), stop_ids=(0,), num_output=0) == 0           # min_tokens 0: nothing held back
    assert pick(SamplingParams(temperature=0, min_tokens=2), stop_ids=(0,), num_output=1) == 1
    assert pick(SamplingParams(temperature=0, min_tokens=2), stop_ids=(0,), num_output=2) == 0
    # repetition: 3 / 2 = 1.5 < 2 -> token 1; a negative logit is multiplied (-1 * 2 = -2).
    assert pick(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0]) == 1
    x = SamplingBatch.build([SampleRow(SamplingParams(repetition_penalty=2.0), 0, prompt_ids=[3],
                                       output_ids=[0])]).processed_logits(logits)
    assert x[0].tolist() == [1.5, 2.0, 1.0, -2.0, -2.0]
    # frequency counts occurrences in the output (not the prompt); presence counts once.
    x = SamplingBatch.build([SampleRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 0,
                                       prompt_ids=[2], output_ids=[0, 0, 1])]).processed_logits(logits)
    assert x[0].tolist() == [3.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, 1.0, -1.0, -2.0]
    # min_p 0.3: p(v) / p(max) = exp(x_v - 3) >= 0.3 keeps tokens 0 and 1 only.
    seen = {int(SamplingBatch.build([SampleRow(SamplingParams(min_p=0.3), k)]).sample_on_host(logits)[0])
            for k in keys(9, 300)}
    assert seen == {0, 1}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_logprobs_host_and_device_are_the_raw_log_softmax(device):
    """Chosen-token and top-N logprobs, host and device, against torch.log_softmax."""
    torch, dev = _torch_device(device)
    from glm_fused.engine.sampling import logprobs_on_host
    from glm_fused.torch_backend import OPS

    logits = (3.0 * np.random.default_rng(5).standard_normal((6, 200))).astype(np.float32)
    targets = np.array([0, 5, 199, 42, 7, 7])
    want = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
    host = logprobs_on_host(logits, targets, 4)
    out = OPS.logprobs(torch.from_numpy(logits).to(dev), torch.from_numpy(targets).to(dev), 4)
    device = [t.cpu().numpy() for t in out]
    for chosen, ids, values in (host, device):
        np.testing.assert_allclose(chosen, want[np.arange(6), targets], rtol=0, atol=1e-5)
        assert (ids == np.argsort(-want, -1)[:, :4]).all()
        np.testing.assert_allclose(values, np.take_along_axis(want, ids, -1), rtol=0, atol=1e-5)
    assert logprobs_on_host(logits, targets, 0)[1].shape == (6, 0)


def _chi2_sf_even_df(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable X with an even number of degrees of freedom:
    exp(-x/2) * sum_{i < df/2} (x/2)^i / i! (closed form; no scipy needed)."""
    term, total = 1.0, 1.0
    for i in range(1, df // 2):
        term *= (x / 2) / i
        total += term
    return math.exp(-x / 2) * total


def _chi2_threshold(df: int, alpha: float) -> float:
    """The x with P(X >= x) = alpha, by bisection on the closed form."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _chi2_sf_even_df(mid, df) > alpha else (lo, mid)
    return hi


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_sampling_frequencies_follow_softmax_at_the_temperature(temperature, where):
    """20000 draws against softmax(logits / T), Pearson's chi-square goodness of fit, for the
    host sampler and the device one (``TorchOps.sample``, here on CPU tensors).

    9 tokens give 8 degrees of freedom; every expected count is >= 30 at both temperatures
    (the chi-square approximation needs >= 5). The threshold is the statistic's 1 - 1e-6
    quantile (computed below, 42.70): a correct sampler fails with probability 1e-6 per case
    for random keys, and these keys are fixed (one seed, output steps 0..19999). A sampler
    that ignores T (draws from softmax(logits)) scores in the thousands at T = 0.7 and T = 2.
    """
    logits = np.array([0.5, -2.0, 2.0, 1.0, -0.5, 0.0, 1.5, -1.5, -1.0], dtype=np.float32)
    want = np.exp(logits.astype(np.float64) / temperature)
    want /= want.sum()
    n = 20000
    expected = n * want
    assert expected.min() >= 30
    params = SamplingParams(temperature=temperature)
    if where == "host":
        drawn = [sample(logits, params, k) for k in keys(20240, n)]
    else:
        torch = pytest.importorskip("torch")
        from glm_fused.engine.sampling import SamplingBatch
        from glm_fused.torch_backend import OPS

        batch = SamplingBatch.build([(params, k) for k in keys(20240, n)])
        drawn = OPS.sample(torch.from_numpy(np.tile(logits, (n, 1))), batch).numpy()
    counts = np.bincount(drawn, minlength=len(logits))
    stat = float(((counts - expected) ** 2 / expected).sum())
    threshold = _chi2_threshold(df=len(logits) - 1, alpha=1e-6)
    assert 42.6 < threshold < 42.8  # scipy.stats.chi2.isf(1e-6, 8) = 42.70
    assert stat < threshold, f"{where}, T={temperature}: chi-square {stat:.1f} >= {threshold:.1f}; counts {counts.tolist()}"


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -3}, "seed"),
    ({"stop": ["x"] * 17}, "stop"),
])
def test_invalid_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


# ---- text ----------------------------------------------------------------------------------
TEXT = "héllo wörld ✓ end"


@pytest.fixture(scope="module")
def tok():
    from glm_fused.tiny import ensure_tiny_checkpoint
    from glm_fused.tokenizer import Tokenizer

    return Tokenizer(ensure_tiny_checkpoint())


def test_stop_string_across_tokens_cuts_text_and_holds_back(tok):
    # The tiny tokenizer is byte-level BPE: multi-byte characters arrive in pieces.
    for include, expected in ((False, "héllo "), (True, "héllo wör")):
        params = SamplingParams(max_tokens=100, stop=["wör", "zzz"], include_stop_str_in_output=include)
        seq = Sequence("r", [1], params, detokenizer=tok.text_stream())
        streamed = []
        for t in tok.encode(TEXT):
            seq.append_token(t, frozenset(), 1000)
            if seq.finish_reason:
                seq.finish(seq.finish_reason)
            streamed.append(seq.take_text_delta())
            assert "w" not in "".join(streamed) or seq.finished  # "w" may start "wör": held back
            if seq.finished:
                break
        assert seq.finish_reason == "stop"
        assert seq.text == expected == "".join(streamed)


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode(TEXT)
    params = SamplingParams(max_tokens=100, stop=["é"], min_tokens=len(tok.encode("hél")))
    seq = Sequence("r", [1], params, detokenizer=tok.text_stream())
    for t in ids:
        seq.append_token(t, frozenset(), 1000)
        if seq.finish_reason:
            break
    assert seq.finish_reason is None and seq.text == TEXT  # its only "é" came before min_tokens


def test_eos_and_stop_token_ids_finish_with_stop_unless_ignored():
    for params, reason, n in [(SamplingParams(max_tokens=5), "stop", 1),
                              (SamplingParams(max_tokens=5, ignore_eos=True), "length", 5),
                              (SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[9]), "stop", 1)]:
        seq = Sequence("r", [1], params)
        while seq.finish_reason is None:
            seq.append_token(9, frozenset({9}), 1000)
        assert (seq.finish_reason, len(seq.output_token_ids)) == (reason, n)


# ---- scheduler -----------------------------------------------------------------------------
def test_device_time_counts_every_step_prompt_chunks_included():
    """engine.device_seconds (/metrics' engine_device_seconds) sums every step's device time:
    a prompt chunk's, which has no tokens to wait for, is added once a later step's are in;
    decode_device_seconds keeps the decode-only steps."""
    engine, runner = make_engine(budget=8)
    engine.add_request("a", list(range(1, 21)), greedy(3))  # 20 tokens in chunks of 8: 2 steps sample nothing
    while engine.has_unfinished():
        engine.step()
    chunks = [b for b in runner.batches if int(b.query_lens.max()) > 1]
    assert len(chunks) == 3 and len(runner.step_seconds) == len(runner.batches)
    assert engine.device_seconds == pytest.approx(sum(runner.step_seconds), rel=1e-9)
    assert engine.num_decode_steps == 2  # tokens 2 and 3
    decodes = [t for t, b in zip(runner.step_seconds, runner.batches) if int(b.query_lens.max()) == 1]
    assert engine.decode_device_seconds == pytest.approx(sum(decodes), rel=1e-9)


def test_chunked_prefill_respects_budget_and_joins_between_steps():
    sched = Scheduler(settings(2, 64, 8))
    a = Sequence("a", list(range(20)), greedy())
    sched.add(a)

    def step_and_commit():
        step = sched.schedule()
        sched.commit(step)
        return ([s.request_id for s in step.seqs], list(step.num_new), list(step.batch.context_lens),
                step.sample)

    assert step_and_commit() == (["a"], [8], [0], [False])
    sched.add(Sequence("b", [1, 2, 3], greedy()))   # arrives mid-prefill
    assert step_and_commit() == (["a"], [8], [8], [False])       # budget spent on a's chunk
    assert step_and_commit() == (["a", "b"], [4, 3], [16, 0], [True, True])  # b joins
    b = sched.running[1]
    assert (a.num_inflight, b.num_inflight) == (1, 1)  # each sampled a token on the device
    c = Sequence("c", [4, 5], greedy())
    sched.add(c)
    # The next step feeds those tokens before the host has seen them: placeholders (-1).
    step = sched.schedule()
    assert list(step.batch.input_ids) == [-1, -1] and list(step.batch.positions) == [20, 3]
    assert list(step.batch.rows) == [a.row, b.row] and a.row != b.row
    sched.commit(step)
    for seq in (a, b):  # the host collects the first tokens
        seq.num_inflight -= 1
        seq.output_token_ids.append(1)
    assert ([s.request_id for s in step.seqs], list(step.num_new), step.sample) == (["a", "b"], [1, 1], [True, True])
    assert sched.num_running == 2 and sched.num_waiting == 1  # max_num_seqs: c waits
    b_blocks, b_row = list(b.block_table), b.row
    sched.finish(b, "stop")                  # b leaves; c takes its place in the very next step
    assert step_and_commit() == (["a", "c"], [1, 2], [21, 0], [True, True])
    # b's one full block stays cached (free, findable); c got a block that never held anything,
    # and b's row of per-sequence state.
    kept = sched.blocks.blocks[b_blocks[0]]
    assert b.block_table == [] and kept.ref_count == 0 and kept.hash is not None
    assert c.block_table[0] not in b_blocks and c.row == b_row and b.row is None

def test_a_sequence_with_all_its_tokens_in_flight_is_not_scheduled():
    sched = Scheduler(settings(2, 64, 8))
    a = Sequence("a", [1, 2, 3], greedy(1))  # one token to make: the prefill samples it
    sched.add(a)
    sched.commit(sched.schedule())
    assert a.num_inflight == 1 and not a.wants_more
    assert sched.schedule() is None  # nothing to feed until the host has seen it


def test_decodes_go_first_and_budget_is_never_exceeded():
    engine, runner = make_engine(max_num_seqs=4, budget=6)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, greedy(8))
    while engine.has_unfinished():
        engine.step()
    for batch in runner.batches:
        assert batch.num_tokens <= 6 and batch.num_seqs <= 4
        decode = batch.query_lens == 1
        first_prefill = np.argmax(~decode) if (~decode).any() else len(decode)
        assert decode[:first_prefill].all()  # decodes lead the batch
    assert any((b.context_lens > 0).any() and (b.query_lens > 1).any() for b in runner.batches), \
        "no chunked prefill happened"


# ---- engine --------------------------------------------------------------------------------
def run_alone(prompt, params):
    engine, _ = make_engine(max_num_seqs=1, budget=64)
    return engine.generate([prompt], params)[0].output_token_ids


def test_greedy_same_alone_and_in_a_busy_batch():
    alone = [run_alone(p, greedy()) for p in PROMPTS]
    # Busy: few slots, a small budget (chunked prefill, queueing), staggered arrivals.
    engine, runner = make_engine(max_num_seqs=3, budget=7)
    seqs = []
    for i, p in enumerate(PROMPTS):
        seqs.append(engine.add_request(str(i), p, greedy()))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == alone
    assert max(b.num_seqs for b in runner.batches) == 3


def test_seeded_sampling_same_alone_and_in_a_batch():
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=i) for i in range(4)]
    alone = [run_alone(p, sp) for p, sp in zip(PROMPTS, params)]
    engine, _ = make_engine(max_num_seqs=4, budget=9)
    assert [s.output_token_ids for s in engine.generate(PROMPTS[:4], params)] == alone


def test_length_limits_and_context_limit():
    engine, _ = make_engine(max_model_len=16, budget=16)
    seq = engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 4
    with pytest.raises(InvalidParam) as info:
        engine.check_prompt([1] * 10, SamplingParams(max_tokens=7))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidParam) as info:
        engine.check_prompt([1] * 16, SamplingParams(max_tokens=1), param="messages")
    assert info.value.param == "messages"
    with pytest.raises(InvalidParam) as info:
        engine.check_prompt([1, VOCAB], SamplingParams(max_tokens=1))
    assert info.value.param == "prompt" and str(VOCAB) in str(info.value)


def test_a_prompt_is_one_array_on_its_way_to_the_first_token():
    """The checks turn a prompt into one int64 array, which the engine takes as is (the
    server's preprocessing hands it over); the sequence keeps a copy, reads slices of it, and
    makes the prompt a list of ints only when asked. An id past 64 bits is named, with or
    without a vocabulary."""
    from glm_fused.engine.llm_engine import check_prompt

    prompt = np.array(PROMPTS[5], dtype=np.int64)
    assert check_prompt(prompt, greedy(), max_model_len=64, vocab_size=VOCAB) is prompt
    assert check_prompt(PROMPTS[5], greedy(), max_model_len=64, vocab_size=None).tolist() == PROMPTS[5]
    for vocab in (VOCAB, None):
        with pytest.raises(InvalidParam) as info:
            check_prompt([1, 2**64], greedy(), max_model_len=64, vocab_size=vocab, param="prompt.1")
        assert info.value.param == "prompt.1"
    engine, runner = make_engine(max_num_seqs=2, budget=8)
    seq = engine.add_request("a", prompt, greedy())
    prompt[:] = 0  # the caller's array, changed afterwards
    while engine.has_unfinished():
        engine.step()
    assert "prompt_token_ids" not in vars(seq)  # no list was made on the way
    assert seq.output_token_ids == run_alone(PROMPTS[5], greedy())
    assert seq.prompt_token_ids == PROMPTS[5] and all(type(t) is int for t in seq.prompt_token_ids)
    assert [int(t) for b in runner.batches for t in b.input_ids][:len(PROMPTS[5])] == PROMPTS[5]


def test_eos_finishes_and_frees_the_blocks():
    engine, _ = make_engine(max_num_seqs=1)
    first = engine.generate([[5, 6]], greedy(1))[0].output_token_ids[0]
    engine2, _ = make_engine(max_num_seqs=1, eos_token_ids=[first])
    seq = engine2.generate([[5, 6]], greedy(10))[0]
    assert seq.finish_reason == "stop" and seq.output_token_ids == [first]
    assert engine2.kv_cache_stats()["usage"] == 0.0 and seq.block_table == []


def test_abort_frees_blocks_at_once():
    engine, runner = make_engine(max_num_seqs=1, budget=32)
    engine.add_request("a", [1, 2, 3], greedy(50))
    engine.add_request("b", [4, 5], greedy(3))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.num_running == 0 and engine.kv_cache_stats()["usage"] == 0.0
    # The very next step launches b; a's token, still in flight, is dropped.
    assert engine.step() == []
    assert list(runner.batches[-1].input_ids) == [4, 5]
    assert [o.request_id for o in engine.step()] == ["b"]
    assert engine.abort("missing") is None
    assert [o.request_id for o in engine.abort_all()] == ["b"]
    while engine.has_unfinished():  # collects b's last launched step, whose row is now a spare
        assert engine.step() == []

def test_broadcast_protocol_workers_see_every_forward():
    """Rank 0 broadcasts each step; a worker loop (here a thread) replays it, then stops."""
    pipe: queue.Queue = queue.Queue()
    worker_runner = FakeRunner(settings(2, 64, 5).num_kv_blocks)

    def receive(_none, src=0):
        return pipe.get(timeout=10)

    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("steps", run_worker(worker_runner, receive)))
    thread.start()
    engine, runner = make_engine(max_num_seqs=2, budget=5, broadcast=pipe.put, heartbeat_s=0.0)
    engine.heartbeat()                 # idle: a no-op goes out
    seqs = engine.generate(PROMPTS[:3], greedy(6))
    engine.stop_workers()
    engine.stop_workers()              # only one stop message
    thread.join(10)
    assert not thread.is_alive() and done["steps"] == len(runner.batches) == len(worker_runner.batches)
    for a, b in zip(runner.batches, worker_runner.batches):
        assert np.array_equal(a.to_array(), b.to_array())
    assert all(s.finished for s in seqs)
    assert pipe.empty()


def test_idle_ping_is_answered_with_a_barrier():
    """With a barrier, an idle heartbeat is a round trip: rank 0 pings, then both sides meet."""
    pipe: queue.Queue = queue.Queue()
    meet = threading.Barrier(2, timeout=10)
    thread = threading.Thread(target=run_worker, args=(FakeRunner(1, 8), lambda _a, src=0: pipe.get(timeout=10)),
                              kwargs={"barrier": meet.wait})
    thread.start()
    engine, _ = make_engine(broadcast=pipe.put, barrier=meet.wait, heartbeat_s=0.0)
    engine.heartbeat()                 # returns only once the worker has answered
    assert meet.n_waiting == 0
    engine.stop_workers()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="no barrier"):
        run_worker(FakeRunner(1, 8), lambda _a, src=0: np.array([CMD_PING]))


def test_worker_rejects_unknown_command():
    msgs = iter([np.array([CMD_NOOP]), np.array([99])])
    with pytest.raises(RuntimeError, match="unknown command"):
        run_worker(FakeRunner(1, 8), lambda _a, src=0: next(msgs))


def test_text_output_matches_full_decode_when_streamed(tok):
    engine, _ = make_engine(tokenizer=tok)
    pieces = {}
    seqs = engine.generate(PROMPTS[:2], greedy(10),
                           on_output=lambda o: pieces.setdefault(o.request_id, []).append(o.text_delta))
    for seq in seqs:
        assert "".join(pieces[seq.request_id]) == seq.text == tok.decode(seq.output_token_ids)


# ---- engine --------------------------------------------------------------------------------
SYSTEM = list(range(3, 22))  # 19 tokens: four full blocks of 4 and three more
SHARED = [SYSTEM + [40 + i, 50 + i, 60 - i] for i in range(6)]


def run_staggered(engine, prompts, params, every=2):
    """Add a request every ``every`` steps (so later ones find earlier ones' blocks cached)."""
    seqs, pending = [], list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            seqs.append(engine.add_request(str(i), p, params))
        for _ in range(every):
            engine.step()
    return seqs


def test_prefix_cache_hits_share_blocks_and_change_nothing():
    alone = [run_alone(p, greedy()) for p in SHARED]
    engine, runner = make_engine(max_num_seqs=4, budget=32)
    seqs = run_staggered(engine, SHARED, greedy())
    assert [s.output_token_ids for s in seqs] == alone
    stats = engine.kv_cache_stats()
    # Every request after the first finds the system prompt's 4 full blocks (16 tokens) cached.
    assert stats["prefix_cache_hits"] == 5 * 16
    assert stats["prefix_cache_queries"] == sum(len(p) for p in SHARED)
    # ... and starts its first step after them: context 16, only the rest fed.
    firsts = [b for b in runner.batches if (b.context_lens == 16).any() and (b.query_lens > 1).any()]
    assert len(firsts) == 5

    off, runner_off = make_engine(max_num_seqs=4, budget=32, prefix_caching=False)
    assert [s.output_token_ids for s in run_staggered(off, SHARED, greedy())] == alone
    assert off.kv_cache_stats()["prefix_cache_hits"] == 0
    assert sum(b.num_tokens for b in runner_off.batches) > sum(b.num_tokens for b in runner.batches) + 5 * 16 - 1


def test_preemption_by_a_tiny_block_budget_loses_nothing_and_changes_nothing():
    prompts = PROMPTS + SHARED
    alone = [run_alone(p, greedy(20)) for p in prompts]
    for caching in (True, False):
        # 12 blocks of 4 = 48 positions: at most a few sequences fit at once; one of 39 + 20 does.
        engine, _ = make_engine(max_num_seqs=6, max_model_len=60, budget=24, num_blocks=15, prefix_caching=caching)
        seqs = [engine.add_request(str(i), p, greedy(20)) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
            assert engine.kv_cache_stats()["usage"] <= 1.0
        assert [s.output_token_ids for s in seqs] == alone, f"prefix caching {caching}"
        assert all(s.finish_reason == "length" for s in seqs)
        stats = engine.kv_cache_stats()
        assert stats["num_preemptions"] > 0 and stats["usage"] == 0.0
        assert sum(s.num_preemptions for s in seqs) == stats["num_preemptions"]


def _random_schedule(seed: int) -> tuple[list, dict, set, dict]:
    """One random run: its requests (shared system prompts, repeats; greedy, seeded, penalised,
    logprobs, stop tokens), a random engine (slots, token budget, a block budget down to one
    full-length sequence, prefix caching on or off), arrivals and aborts between steps."""
    r = random.Random(seed)
    length, min_blocks = 64, 64 // BLOCK
    cfg = dict(max_num_seqs=r.randint(1, 6), budget=r.choice([4, 5, 7, 8, 16, 32, 64]),
               num_blocks=r.choice([min_blocks, min_blocks + 1, r.randint(min_blocks, 3 * min_blocks)]),
               prefix_caching=r.random() < 0.7)
    systems = [[r.randrange(1, VOCAB) for _ in range(r.randint(0, 24))] for _ in range(3)]
    requests = []
    for i in range(r.randint(3, 14)):
        prompt = (r.choice(systems) + [r.randrange(1, VOCAB) for _ in range(r.randint(1, 16))])[:length - 2]
        if requests and r.random() < 0.15:
            prompt = list(r.choice(requests)[1])
        n = r.randint(1, min(24, length - len(prompt)))
        kind = r.random()
        if kind < 0.55:
            params = greedy(n)
        elif kind < 0.75:
            params = SamplingParams(max_tokens=n, temperature=0.8, seed=r.randrange(10**6), top_k=r.choice([0, 5]))
        elif kind < 0.85:
            params = SamplingParams(max_tokens=n, temperature=r.choice([0.0, 0.7]), seed=r.randrange(10**6),
                                    repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={r.randrange(VOCAB): 2.0})
        elif kind < 0.93:
            params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=r.choice([0, 2]),
                                    prompt_logprobs=r.choice([None, 0, 3]))
        else:
            params = SamplingParams(max_tokens=n, temperature=0.0, min_tokens=r.randint(0, min(2, n)),
                                    stop_token_ids=[r.randrange(1, VOCAB) for _ in range(3)])
        requests.append((str(i), prompt, params))
    engine, _ = make_engine(max_model_len=length, **cfg)
    pending, seqs, aborted = list(requests), {}, set()
    for _ in range(5000):
        if not (pending or engine.has_unfinished()):
            break
        while pending and r.random() < 0.5:
            rid, prompt, params = pending.pop(0)
            seqs[rid] = engine.add_request(rid, prompt, params)
        if seqs and r.random() < 0.06:
            rid = r.choice(list(seqs))
            if not seqs[rid].finished:
                engine.abort(rid)
                aborted.add(rid)
        engine.step()
        assert engine.kv_cache_stats()["usage"] <= 1.0
    assert not engine.has_unfinished(), f"seed {seed}: no progress in 5000 steps ({cfg})"
    blocks = engine.scheduler.blocks
    assert engine.kv_cache_stats()["usage"] == 0.0 and all(b.ref_count == 0 for b in blocks.blocks), cfg
    assert all(blocks.blocks[i].hash == h for h, i in blocks.cached.items()), cfg
    return requests, seqs, aborted, cfg


@pytest.mark.parametrize("first", range(0, 240, 40))
def test_random_schedules_give_every_request_its_output_alone(first):
    """Whatever shares the batch, arrives, is aborted or preempted, and whatever the prefix cache
    holds: each request's tokens, finish reason and logprobs are those of the same request run
    alone (an aborted one's, a prefix of them); at the end every block is free and the cache's
    keys agree with its blocks. 40 random runs per case, seeded."""
    for seed in range(first, first + 40):
        requests, seqs, aborted, cfg = _random_schedule(seed)
        for rid, prompt, params in requests:
            got, engine = seqs[rid], make_engine(max_num_seqs=1, budget=64)[0]
            ref = engine.generate([prompt], params)[0]
            where = (seed, rid, cfg)
            if rid in aborted:
                assert got.output_token_ids == ref.output_token_ids[:len(got.output_token_ids)], where
                continue
            assert (got.output_token_ids, got.finish_reason) == (ref.output_token_ids, ref.finish_reason), where
            assert (got.output_logprobs, got.prompt_logprobs) == (ref.output_logprobs, ref.prompt_logprobs), where


# ---- rules that need the host: grammar and penalties; logprobs ------------------------------
class PathGrammar:
    """A stand-in for ``GrammarState``: allows exactly ``path``, then only ``stop``."""

    def __init__(self, path: list[int], stop: int, vocab: int = VOCAB):
        self.path, self.stop, self.vocab, self.pos, self.terminated = path, stop, vocab, 0, False

    def next_bitmask(self) -> np.ndarray:
        allowed = np.zeros(self.vocab + (-self.vocab % 32), bool)
        allowed[self.path[self.pos] if self.pos < len(self.path) else self.stop] = True
        return np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)

    def accept(self, token: int) -> bool:
        want = self.path[self.pos] if self.pos < len(self.path) else self.stop
        if token != want:
            return False
        self.pos += 1
        self.terminated = token == self.stop
        return True


def placeholder_rows(runner, row: int) -> int:
    """How many steps fed the sequence in state ``row`` a token still in flight (-1)."""
    return sum(int((b.input_ids[b.seq_starts[i]:b.seq_starts[i] + b.query_lens[i]] < 0).any())
               for b in runner.batches for i in range(b.num_seqs) if b.rows[i] == row)


def test_grammar_sequence_waits_for_its_token_and_the_others_keep_theirs():
    free = run_alone(PROMPTS[1], greedy(10))
    engine, runner = make_engine(max_num_seqs=2, budget=32, eos_token_ids=[63])
    path = [5, 9, 13, 9, 5]
    ruled = engine.add_request("g", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.9, seed=1),
                               grammar=PathGrammar(path, stop=63))
    other = engine.add_request("o", PROMPTS[1], greedy(10))
    while engine.has_unfinished():
        engine.step()
    assert ruled.output_token_ids == path + [63] and ruled.finish_reason == "stop"
    assert other.output_token_ids == free  # its rows are the same in the shared batch
    assert placeholder_rows(runner, 0) == 0  # never fed a token it had not seen on the host


def test_penalties_follow_the_reference_with_the_whole_history():
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.9,
                            presence_penalty=0.3, logit_bias={7: 1.5})
    engine, runner = make_engine(max_num_seqs=2, budget=32)
    seq = engine.add_request("p", PROMPTS[3], params)
    engine.add_request("q", PROMPTS[4], greedy(12))  # shares the batch, overlapped
    while engine.has_unfinished():
        engine.step()
    # The reference: the fake model's logits at each position, the host rule with the history.
    ref, out = FakeRunner(1, 64), []
    for _ in range(12):
        logits = ref._logits(np.array(PROMPTS[3] + out))[None].astype(np.float32)
        row = SampleRow(params, 0, prompt_ids=PROMPTS[3], output_ids=out)
        out.append(int(SamplingBatch.build([row]).sample_on_host(logits)[0]))
    assert seq.output_token_ids == out
    assert out != run_alone(PROMPTS[3], greedy(12))  # the penalties changed something
    assert placeholder_rows(runner, 0) == 0  # p was admitted first: state row 0


def test_min_tokens_holds_eos_back():
    first = run_alone(PROMPTS[2], greedy(1))[0]
    engine, _ = make_engine(eos_token_ids=[first])
    seq = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4))[0]
    assert len(seq.output_token_ids) >= 4 and first not in seq.output_token_ids[:4]


def test_logprobs_and_prompt_logprobs_over_chunked_prefill():
    """Output and prompt logprobs are the fake model's log_softmax at each position, also when
    the prompt is prefilled in chunks (budget 5, prompt of 25) beside other sequences."""
    def log_softmax(x):
        x = x.astype(np.float64)
        return x - (x.max() + np.log(np.exp(x - x.max()).sum()))

    engine, runner = make_engine(max_num_seqs=3, budget=5)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    seq = engine.add_request("e", PROMPTS[1], params)
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=0))
    while engine.has_unfinished():
        engine.step()
    ref = FakeRunner(1, 64)
    tokens = PROMPTS[1] + seq.output_token_ids
    assert len(seq.prompt_logprobs) == len(PROMPTS[1]) and seq.prompt_logprobs[0] is None
    for i in range(1, len(tokens)):
        lp = log_softmax(ref._logits(np.array(tokens[:i])))
        entry = seq.prompt_logprobs[i] if i < len(PROMPTS[1]) else seq.output_logprobs[i - len(PROMPTS[1])]
        chosen, ids, values = entry
        k = 2 if i < len(PROMPTS[1]) else 3
        assert abs(chosen - lp[tokens[i]]) < 1e-5 and ids == np.argsort(-lp)[:k].tolist()
        np.testing.assert_allclose(values, lp[ids], atol=1e-5)
    assert len(seq.output_logprobs) == 4
    assert any((b.query_lens > 1).any() and (b.context_lens > 0).any() for b in runner.batches)


def test_unseeded_requests_follow_the_global_seed():
    def outputs(seed):
        engine, _ = make_engine(max_num_seqs=2)
        engine.seed = seed
        return [s.output_token_ids for s in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8))]

    assert outputs(0) == outputs(0)
    assert outputs(0) != outputs(1)
    a, b = outputs(5)
    assert a != b or PROMPTS[0] == PROMPTS[1]


# ---- the real runner: logprobs of the model's own forward ------------------------------------
def _runner_run(backend: str) -> list[int]:
    """Prompt and output logprobs of the tiny checkpoint (TP 1, CPU) checked against the
    runner's plain forward; returns the seeded draws of a second request."""
    from glm_fused.cli.common import Rank
    from glm_fused.engine_args import EngineArgs
    from glm_fused.tiny import ensure_tiny_checkpoint
    from glm_fused.tokenizer import Tokenizer

    args = EngineArgs(model="glm-4.5-air-tiny", backend=backend, device="cpu", max_num_seqs=2, max_model_len=64,
                      max_num_batched_tokens=8).resolve()
    rank = Rank(args)
    runner = rank.build_runner()
    tok = Tokenizer(ensure_tiny_checkpoint())
    engine = LLMEngine(runner, args, vocab_size=rank.config.vocab_size, tokenizer=tok)
    prompt = tok.encode("The lighthouse stands at the end of the long road", add_special_tokens=True)
    scored = engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=2,
                                                            prompt_logprobs=1, repetition_penalty=1.3))
    drawn = engine.add_request("b", prompt[:5], SamplingParams(max_tokens=5, temperature=1.0, seed=4, min_p=0.05,
                                                               logit_bias={3: 2.0}))
    while engine.has_unfinished():
        engine.step()
    full = prompt + scored.output_token_ids
    args.max_num_batched_tokens = 64  # one forward over the whole sequence
    logits = runner.forward(ForwardBatch.prefill([full], runner.slot_tables([0]), all_logits=True)).astype(np.float64)
    runner.close()
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    entries = scored.prompt_logprobs[1:] + scored.output_logprobs
    assert len(entries) == len(full) - 1 and scored.prompt_logprobs[0] is None
    for i, (chosen, ids, values) in enumerate(entries):
        assert abs(chosen - lp[i, full[i + 1]]) < 1e-4, (backend, i)
        assert ids[0] == int(np.argmax(lp[i])) and abs(values[0] - lp[i].max()) < 1e-4, (backend, i)
    return drawn.output_token_ids


@pytest.mark.timeout(240)
def test_runner_logprobs_are_the_forward_log_softmax():
    """ModelRunner.execute: prompt logprobs of a prompt prefilled in chunks (8 tokens a step)
    and output logprobs equal log_softmax of the plain forward over the whole sequence (fp32:
    within 1e-4), on Paddle (host sampler) and torch (device sampler), whose seeded draws
    under min_p, logit_bias and a penalised neighbour are the same."""
    pytest.importorskip("torch")
    pytest.importorskip("paddle")
    assert _runner_run("paddle") == _runner_run("torch")


def test_runner_refuses_a_device_its_process_was_not_given(monkeypatch):
    """A runner built outside the launcher: settings for a GPU in a process the launcher did
    not give one (GLM_FUSED_DEVICE unset means cpu) stop at once, naming both, rather than
    build the model on the CPU; and the other way round."""
    pytest.importorskip("torch")
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    monkeypatch.delenv("GLM_FUSED_DEVICE", raising=False)
    args = EngineArgs(model="glm-4.5-air-tiny", backend="torch", device="cpu", max_num_seqs=2,
                      max_model_len=64).resolve()
    args.device = "gpu"  # as resolved on a machine with a GPU
    with pytest.raises(RuntimeError, match="settings say device gpu, but this process's GLM_FUSED_DEVICE is cpu"):
        ModelRunner(args, args.config(), tp_rank=0, tp_size=1)
    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")
    args.device = "cpu"
    with pytest.raises(RuntimeError, match="device cpu, but .* is gpu"):
        ModelRunner(args, args.config(), tp_rank=0, tp_size=1)


@pytest.mark.timeout(240)
def test_kernel_warm_up_leaves_the_runner_unchanged():
    """ModelRunner._warm_up (before serving, where kernels compile per shape class: Triton on a
    GPU) runs prompt and mixed steps through the KV cache: greedy outputs after it are those of
    a runner that never ran it."""
    pytest.importorskip("torch")
    from glm_fused.cli.common import Rank
    from glm_fused.engine_args import EngineArgs

    outputs = []
    for warm in (False, True):
        args = EngineArgs(model="glm-4.5-air-tiny", backend="torch", device="cpu", max_num_seqs=2, max_model_len=64,
                          max_num_batched_tokens=24).resolve()
        rank = Rank(args)
        runner = rank.build_runner()
        if warm:
            runner._warm_up()
        engine = LLMEngine(runner, args, vocab_size=rank.config.vocab_size)
        outputs.append([s.output_token_ids for s in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6,
                                                                                                  temperature=0))])
        runner.close()
    assert outputs[0] == outputs[1] and all(len(o) == 6 for o in outputs[0])
