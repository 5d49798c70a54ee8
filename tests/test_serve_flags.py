"""serve.py's vLLM-style flags, the backend choice, the access log, and request shaping that
depends on the server's flags; in process (no rank starts), fast."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from glm_fused.cli import serve
from glm_fused.engine_args import EngineArgs
from glm_fused.errors import UserError


def refused(argv: list[str], capsys) -> str:
    """serve.py with these flags: exit status 2 and one `error:` line (returned)."""
    assert serve.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.timeout(120)
def test_vllm_style_flags_are_checked_before_any_rank_starts(capsys, tmp_path):
    assert "--tp 3" in refused(["glm-4.5-air-tiny", "-tp", "3"], capsys)  # vLLM's spellings of --tp
    assert "--tp 3" in refused(["--tensor-parallel-size", "3"], capsys)
    assert "given twice" in refused(["glm-4.5-air-tiny", "--model", "GLM-4.5-Air"], capsys)
    assert "--tool-call-parser" in refused(["--enable-auto-tool-choice"], capsys)
    assert "--chat-template" in refused(["--chat-template", str(tmp_path / "missing.jinja")], capsys)
    assert "a directory, not a file" in refused(["--chat-template", str(tmp_path)], capsys)
    assert "--served-model-name is empty" in refused(["--served-model-name", " "], capsys)  # was: served as --model
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert "--chat-template" in refused(["--chat-template", str(broken)], capsys)
    assert "--revision" in refused(["glm-4.5-air-tiny", "--revision", "main"], capsys)
    assert "--seed" in refused(["--seed", "-1"], capsys)
    assert "--max-logprobs" in refused(["--max-logprobs", "-1"], capsys)
    assert "--preprocess-workers -1: must be in 0.." in refused(["--preprocess-workers", "-1"], capsys)
    assert "(the CPUs this process may use)" in refused(["--preprocess-workers", "65536"], capsys)
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--tool-call-parser", "hermes"])  # only GLM's formats
    args = serve.build_parser().parse_args(["glm-4.5-air-tiny", "-tp", "2", "--seed", "7"])
    assert (args.model_tag, args.tp, args.seed, args.backend, args.max_logprobs) == ("glm-4.5-air-tiny", 2, 7,
                                                                                      "auto", 20)


def test_backend_auto_never_falls_to_the_cpu_silently(monkeypatch):
    from glm_fused import engine_args as E

    def resolve(backend, device=None, gpu=False, cuda=()):
        monkeypatch.setattr(E, "gpu_visible", lambda: gpu)
        monkeypatch.setattr(E, "backend_has_cuda", lambda name: name in cuda)
        a = EngineArgs(backend=backend, device=device)
        return a._resolve_backend_and_device()

    assert resolve("auto") == ("paddle", "cpu", "auto: Paddle runs on the CPU")
    assert resolve("auto", gpu=True, cuda=("paddle", "torch"))[:2] == ("paddle", "gpu")
    backend, device, why = resolve("auto", gpu=True, cuda=("torch",))
    assert (backend, device) == ("torch", "gpu") and "only torch can use the GPU" in why
    assert resolve("auto", "cpu", gpu=True, cuda=("torch",))[:2] == ("paddle", "cpu")  # asked for
    assert resolve("torch", gpu=True, cuda=("torch",)) == ("torch", "gpu", "")
    with pytest.raises(UserError, match="--backend paddle.*--device cpu"):
        resolve("paddle", gpu=True, cuda=("torch",))  # a GPU is there: say so, do not run on the CPU
    with pytest.raises(UserError, match="neither Paddle nor torch"):
        resolve("auto", gpu=True)
    with pytest.raises(UserError, match="no GPU is visible"):
        resolve("auto", "gpu")


def test_access_log_one_line_per_request_unless_disabled(caplog):
    from glm_fused.server.access_log import ACCESS_NOTE, AccessLog

    async def app(scope, receive, send):
        scope.setdefault("state", {})[ACCESS_NOTE] = "cmpl-1 prompt_tokens=3 completion_tokens=2 finish=stop"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(wrapper, method, path):
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        await wrapper({"type": "http", "method": method, "path": path, "client": ("127.0.0.1", 5)}, receive, send)

    with caplog.at_level(logging.INFO, logger="glm_fused.access"):
        asyncio.run(call(AccessLog(app), "POST", "/v1/completions"))
        asyncio.run(call(AccessLog(app), "GET", "/health"))          # probes are not logged
        asyncio.run(call(AccessLog(app, enabled=False), "POST", "/v1/completions"))
    lines = [r.getMessage() for r in caplog.records if r.name == "glm_fused.access"]
    assert len(lines) == 1
    assert lines[0].startswith('127.0.0.1:5 "POST /v1/completions" 200 ') and lines[0].endswith(
        "cmpl-1 prompt_tokens=3 completion_tokens=2 finish=stop")


def test_tool_choice_auto_needs_the_flags():
    from glm_fused.server.errors import ApiError
    from glm_fused.server.preprocess import RequestPreprocessor
    from glm_fused.tiny import ensure_tiny_checkpoint
    from glm_fused.tokenizer import Tokenizer

    tok = Tokenizer(ensure_tiny_checkpoint())
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]}).encode()
    plain = RequestPreprocessor(model_name="m", max_model_len=1024, vocab_size=1024, tokenizer=tok)
    with pytest.raises(ApiError) as err:
        plain.prepare("chat", body)
    assert err.value.param == "tool_choice" and "--enable-auto-tool-choice" in err.value.message
    on = RequestPreprocessor(model_name="m", max_model_len=1024, vocab_size=1024, tokenizer=tok,
                             options={"enable_auto_tool_choice": True, "tool_call_parser": "glm45"})
    prep = on.prepare("chat", body)
    assert prep.tool_mode == "auto" and prep.tools and prep.grammar is None and not prep.reasoning
    none = json.loads(body)
    none["tool_choice"] = "none"  # the tools are rendered, the answer is not parsed for calls
    prep = plain.prepare("chat", json.dumps(none).encode())
    assert prep.tools is None and "get_weather" not in tok.decode(prep.prompt_ids.tolist())
    assert '"name": "f"' in tok.decode(prep.prompt_ids.tolist())
