"""lm-evaluation-harness (pinned in the test extras) against the tiny server, as users evaluate
GLM behind vLLM: a multiple-choice task (log-likelihoods from /v1/completions with echo and
logprobs, prompts sent as token ids from the server's /tokenize, two per request) and a
generation task, through ``local-completions`` (batch size 2) and ``local-chat-completions``.
The tasks are local JSONL files (tests/data/lm_eval); lm-eval's results and samples are
stored in the test's directory (``lm_eval_results.json``). Every request must succeed, and
the log-likelihoods lm-eval got must be the model's, checked with transformers' forward of
the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
# lm-eval's Python API, the tasks of this directory only (indexing its built-in tasks takes
# seconds); results and per-sample records to argv[2].
DRIVER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

url, out = sys.argv[1], sys.argv[2]
tasks = TaskManager(include_path=".", include_defaults=False)
runs = {
    "completions": lm_eval.simple_evaluate(
        model="local-completions", model_args=f"base_url={url}/v1/completions,model=glm-4.5-air-tiny,max_retries=1",
        tasks=["glm_tiny_mc", "glm_tiny_gen"], batch_size=2, task_manager=tasks, log_samples=True),
    "chat": lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"base_url={url}/v1/chat/completions,model=glm-4.5-air-tiny,max_retries=1",
        tasks=["glm_tiny_gen"], apply_chat_template=True, task_manager=tasks, log_samples=True),
}
keep = {name: {"results": r["results"], "samples": r["samples"], "versions": r.get("versions")}
        for name, r in runs.items()}
with open(out, "w") as f:
    json.dump(keep, f, default=str, indent=1)
"""


@pytest.mark.timeout(400)
def test_lm_eval_local_completions_and_chat(api_server, tmp_path):
    import torch
    from test_server import metric
    from transformers import AutoModelForCausalLM

    from glm_fused.tiny import ensure_tiny_checkpoint
    from glm_fused.tokenizer import Tokenizer

    errors_before = metric(api_server, "request_errors_total", missing=0.0)  # no error yet: no sample
    done_before = metric(api_server, "request_success_total", missing=0.0)  # none yet: no sample
    out = tmp_path / "lm_eval_results.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-c", DRIVER, api_server.url, str(out)], cwd=DATA, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    completions, chat = got["completions"], got["chat"]
    assert completions["results"]["glm_tiny_mc"]["sample_len"] == 8
    assert 0.0 <= completions["results"]["glm_tiny_mc"]["acc,none"] <= 1.0
    for run_ in (completions, chat):
        assert run_["results"]["glm_tiny_gen"]["sample_len"] == 4
        assert 0.0 <= float(run_["results"]["glm_tiny_gen"]["exact_match,none"]) <= 1.0
        assert all(isinstance(s["resps"][0][0], str) for s in run_["samples"]["glm_tiny_gen"])
    # No request failed: none refused or errored, and every one answered.
    assert metric(api_server, "request_errors_total", missing=0.0) == errors_before
    answered = metric(api_server, "request_success_total") - done_before
    assert answered >= 24 + 4 + 4  # every choice of the 8 questions, 4 + 4 generations

    # The log-likelihoods are the model's: transformers' forward of the same checkpoint, on
    # the tokens lm-eval sent (no special tokens).
    tok = Tokenizer(ensure_tiny_checkpoint())
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_checkpoint(), dtype=torch.float32).eval()
    worst = 0.0
    for sample in completions["samples"]["glm_tiny_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx = tok.encode(context)  # as lm-eval's _encode_pair: the continuation is the rest of the whole
            cont = tok.encode(context + continuation)[len(ctx):]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1).numpy()
            rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
            want = float(logp[rows, cont].sum())
            greedy = bool((logp[rows].argmax(-1) == np.array(cont)).all())
            loglikelihood, is_greedy = resp[0]
            worst = max(worst, abs(loglikelihood - want))
            assert abs(loglikelihood - want) < 2e-3, (context, continuation, loglikelihood, want)
            assert is_greedy == greedy
    print(f"lm-eval results in {out}; largest log-likelihood difference to transformers {worst:.2e}")
