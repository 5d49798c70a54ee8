"""The README's examples run as written, on the tiny default on CPU: the model class, the model
class at TP 4 under torchrun and paddle.distributed.launch, and the quick start's server
answering the README's curl and `openai` examples. Every `python scripts/X.py ...` command of
the README and docs/ parses with that script's own flags.

Only the server's port differs from the README (8000 may be taken where tests run). The quick
start's `pip install` is left out: CI installs the test extras, which hold the serve extra's.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import uuid

import httpx
import pytest

from conftest import ROOT
from test_server import Server

README = (ROOT / "README.md").read_text()
# script -> the module whose build_parser() it runs (the benchmarks without one are left out)
PARSERS = {"serve": "glm_fused.cli.serve", "generate": "glm_fused.cli.generate",
           "logit_diff": "glm_fused.cli.logit_diff", "bench_serve": "bench.bench_serve",
           "bench_attention": "bench.bench_attention", "bench_fusion": "bench.bench_fusion",
           "bench_layers": "bench.bench_layers", "bench_load": "bench.bench_load", "fault_check": "bench.fault_check"}
_COMMAND = re.compile(r"(?:\S+=\S+ )*(?:timeout \d+ )?python3? (?:\S*/)?scripts/(\w+)\.py\b(.*)")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def block_with(lang: str, needle: str) -> str:
    found = [b for b in blocks(README, lang) if needle in b]
    assert len(found) == 1, f"README: {len(found)} {lang} blocks hold {needle!r}"
    return found[0]


def script_commands(text: str) -> list[tuple[str, str]]:
    """(script, its arguments) of each `python scripts/X.py ...` in code blocks and inline code."""
    out = []
    for block in blocks(text, r"(?:bash|sh)?"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                m = _COMMAND.match(part.strip().rstrip("&").strip())
                if m:
                    out.append((m.group(1), m.group(2)))
    out += re.findall(r"`python3? scripts/(\w+)\.py([^`]*)`", text)
    return out


def test_every_documented_command_parses():
    """A flag renamed or dropped leaves no stale command in the README or docs/ (commands with
    shell variables or `<placeholders>` are left out: they are templates, not commands)."""
    checked = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for script, rest in script_commands(doc.read_text()):
            if script not in PARSERS or re.search(r"[$<{]|OLD", rest):
                continue
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    importlib.import_module(PARSERS[script]).build_parser().parse_args(shlex.split(rest))
            except SystemExit:
                pytest.fail(f"{doc.name}: scripts/{script}.py{rest}\n{err.getvalue()}")
            checked += 1
    assert checked >= 30, checked  # the pattern still finds the commands


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(120)
def test_model_class_example():
    out = run_python(block_with("python", "tp_rank=0, tp_size=1"), timeout=100).stdout
    assert re.fullmatch(r".*\[1, 4, 1024\]\)? 4\n", out, re.S), out  # [batch, seq, vocab], 4 layers


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The quick start's first command, the part after its `pip install`, on a free port."""
    command = block_with("bash", "scripts/serve.py glm-4.5-air-tiny").replace("\\\n", " ")
    line = next(line for line in command.splitlines() if "scripts/serve.py" in line)
    argv = shlex.split(line.split("&&", 1)[1])
    assert argv[:2] == ["python", "scripts/serve.py"], argv
    srv = Server(int(argv[argv.index("--tp") + 1]), tmp_path_factory.mktemp("readme") / "serve.log",
                 engine_flags=[], model_args=argv[2:])  # Server adds only --tp (the same) and --port
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_curl_example(quick_start):
    argv = shlex.split(block_with("bash", "curl ").replace("\\\n", " "))
    url = next(a for a in argv if a.startswith("http://127.0.0.1:8000/"))
    header = argv[argv.index("-H") + 1].split(": ", 1)
    body = argv[argv.index("-d") + 1]
    r = httpx.post(url.replace("http://127.0.0.1:8000", quick_start.url), content=body,
                   headers={header[0]: header[1]}, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] <= 32


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_openai_client_example(quick_start):
    code = block_with("python", "from openai import OpenAI")
    assert "http://127.0.0.1:8000/v1" in code
    out = run_python(code.replace("http://127.0.0.1:8000/v1", f"{quick_start.url}/v1"), timeout=200).stdout
    arguments = json.loads(out.splitlines()[-1])  # the forced tool call's arguments, valid JSON
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 16, arguments


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_tensor_parallel_example(tmp_path, framework):
    """The model class at TP 4 under each framework's own launcher, as the README starts it."""
    from test_cli import _processes_with

    code = block_with("python", "tp_logits.py")
    launchers = dict(re.findall(r"(torchrun|paddle\.distributed\.launch) ([^,)\n]*tp_logits\.py)", code))
    if framework == "torch":
        argv = [sys.executable, "-m", "torch.distributed.run", *launchers["torchrun"].split()]
    else:
        argv = [sys.executable, "-m", "paddle.distributed.launch", *launchers["paddle.distributed.launch"].split()]
        code = code.replace("from glm_fused.torch_backend import", "from glm_fused import")  # as the comment says
    (tmp_path / "tp_logits.py").write_text(code)
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               GLM_FUSED_TEST_MARKER=marker)
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert re.search(r"^\(1, 4, 1024\)$", proc.stdout, re.M), proc.stdout[-3000:]  # exit 0: every rank ran it
    assert not _processes_with(marker)
