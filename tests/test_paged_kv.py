"""The paged KV cache end to end on the tiny model: greedy tokens equal to those of the
slot-based cache the engine had before paging (recorded in tests/data/greedy_tiny_slots.json
from scripts/generate.py at TP 1 and TP 4, both frameworks: all four gave the same tokens),
with prefix caching on (hits asserted) and off, and under preemption forced by a block budget
that holds one sequence of the context limit but not two of the prompts (preemptions asserted). Exact equality: fp32 on
CPU, and the paged attention reads the same keys in the same order as the slots did."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import paged_workers  # noqa: E402  (tests/ is on sys.path under pytest)
from glm_fused.launcher import launch

DATA = json.loads((Path(__file__).resolve().parent / "data" / "greedy_tiny_slots.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_greedy_unchanged_by_paging_prefix_caching_and_preemption(tmp_path, framework, tp):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    args = {"out": str(tmp_path), "backend": framework, "prompts": DATA["prompts"],
            "max_new_tokens": DATA["max_new_tokens"]}
    assert launch(paged_workers.run_modes, args, nprocs=tp, device="cpu", timeout=360) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) == set(paged_workers.MODES)
    for name, got in result.items():
        assert got["tokens"] == DATA["greedy"], f"{framework} TP{tp} {name}"
        assert got["stats"]["usage"] == 0.0  # every block given back
    shared = 45 // paged_workers.BLOCK * paged_workers.BLOCK  # prompts 1-3 share prompt 0's first 45 tokens
    assert result["prefix_caching"]["stats"]["prefix_cache_hits"] >= 3 * shared
    assert result["no_prefix_caching"]["stats"]["prefix_cache_hits"] == 0
    assert result["tiny_budget"]["stats"]["num_preemptions"] > 0
    assert sum(result["tiny_budget"]["preempted"]) == result["tiny_budget"]["stats"]["num_preemptions"]


@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_a_prompt_chunk_as_one_token_rows_gives_the_same_logits(framework):
    """``ForwardBatch.as_token_rows``, the shape in which the CUDA decode graphs replay short
    prompt chunks (one row per token, each over its sequence's blocks with position + 1 keys),
    against the same step as chunks, on the eager CPU path: a decode beside a 5-token chunk that
    crosses a block boundary, after cached prompts. fp32, max rel 1e-5 (summation order)."""
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    settings = EngineArgs(model="glm-4.5-air-tiny", load_format="dummy", backend=framework, device="cpu",
                          dtype="float32", max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64,
                          block_size=4, num_gpu_blocks_override=24).resolve()
    runner = ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    rng = np.random.default_rng(0)
    vocab = settings.config().vocab_size
    tables = np.array([[5, 1, 9, 3, 0], [2, 7, 11, 4, 8]])  # scattered blocks of 4
    runner.forward(ForwardBatch.prefill([rng.integers(0, vocab, 6).tolist(), rng.integers(0, vocab, 9).tolist()],
                                        tables))
    step = ForwardBatch(rng.integers(0, vocab, 6), [6, 9, 10, 11, 12, 13], [1, 5], [6, 9], np.arange(6), tables)
    rows = step.as_token_rows()
    assert rows.num_seqs == rows.num_tokens == 6 and (rows.query_lens == 1).all()
    assert rows.context_lens.tolist() == [6, 9, 10, 11, 12, 13] and rows.block_tables.tolist()[2] == tables[1].tolist()
    assert (rows.slot_mapping(4) == step.slot_mapping(4)).all()
    want = runner.forward(step)
    got = runner.forward(rows)  # writes the same cache rows with the same values
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    runner.close()


def test_the_decode_mask_is_made_only_for_the_plain_ops():
    """An all-decode step's padded-keys mask: the plain ops read it (values as the lengths say);
    where a decode kernel reads the lengths instead (``batched_prefill`` not None), none is made."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.model.attention import AttentionMetadata
    from glm_fused.torch_backend import OPS

    tables = np.array([[3, 1, 0], [2, 4, 5]])
    step = ForwardBatch.decode([7, 8], [5, 9], tables)  # contexts 5 and 9: 6 and 10 keys
    like = torch.zeros(1)
    meta = AttentionMetadata.from_batch(step, OPS, like, 4)
    assert meta.decode_mask.shape == (2, 1, 1, 10)
    assert meta.decode_mask[:, 0, 0].sum(1).tolist() == [6, 10] and meta.seq_lens.tolist() == [6, 10]

    class KernelOps(type(OPS)):
        def batched_prefill(self, like):
            return 64

    meta = AttentionMetadata.from_batch(step, KernelOps(), like, 4)
    assert meta.decode_mask is None and meta.seq_lens.tolist() == [6, 10]


def test_kv_cache_messages_count_blocks_in_english():
    """One block is "1 block", in the start-up line and in the refusal alike."""
    from types import SimpleNamespace

    from glm_fused.errors import UserError
    from glm_fused.kv_cache import settle

    args = SimpleNamespace(block_size=16, device="cpu", max_model_len=None)
    assert settle(args, 4096, 1, 64, "--num-gpu-blocks-override").describe().startswith(
        "KV cache 1 block x 16 tokens = 16 tokens")
    assert "KV cache 3 blocks x 16" in settle(args, 4096, 3, 64, "x").describe()
    with pytest.raises(UserError, match=r"holds 16 tokens \(1 block of 16;"):
        settle(SimpleNamespace(block_size=16, device="cpu", max_model_len=64), 4096, 1, 64, "x")
