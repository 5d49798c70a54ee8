"""Shared pytest setup."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests build their own checkpoints; never touch the user's cache.
os.environ.setdefault("GLM_FUSED_CACHE", str(ROOT / ".pytest_cache" / "glm_fused"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and FlashInfer for kernel tests); skipped on CPU")
    config.addinivalue_line("markers", "slow: multi-process or large; still part of the suite")


# ---- one tiny server for the OpenAI-API tests (test_openai_api.py, test_lm_eval.py) -------------
# What a GLM user starts (`vllm serve`'s flags), at TP 2 on CPU, with a chat template of its own:
# the checkpoint's, plus a `prefill` variable that appends text to the generation prompt.
# GLM_FUSED_API_DEVICE=gpu (and GLM_FUSED_API_TP=1) runs the same tests on a GPU server (float32,
# so that the comparisons with transformers keep their tolerance).
API_DEVICE = os.environ.get("GLM_FUSED_API_DEVICE", "cpu")
API_TP = int(os.environ.get("GLM_FUSED_API_TP", "2"))
API_ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "1024", "--max-num-batched-tokens", "256",
                    "--device", API_DEVICE, "--dtype", "float32"]
API_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "glm45", "--reasoning-parser", "glm45",
             "--max-logprobs", "20", "--seed", "0"]
PREFILL = "\n{%- if prefill is defined -%}{{- prefill -}}{%- endif -%}\n"


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    import json

    from test_server import MODEL, Server

    from glm_fused.tiny import ensure_tiny_checkpoint

    config = json.loads((ensure_tiny_checkpoint() / "tokenizer_config.json").read_text())
    work = tmp_path_factory.mktemp("api_server")
    template = work / "chat_template.jinja"
    template.write_text(config["chat_template"] + PREFILL)
    srv = Server(API_TP, work / "serve.log", extra=[*API_FLAGS, "--chat-template", str(template)],
                 engine_flags=API_ENGINE_FLAGS, model_args=[MODEL])  # the model as `vllm serve MODEL` takes it
    srv.template = template
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()
