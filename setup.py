from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="glm_fused",
    version="0.1.0",
    description="GLM-4.5-Air tensor-parallel inference with fused all-reduce + residual + RMSNorm",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["glm_fused", "glm_fused.*"]),
    python_requires=">=3.10",
    install_requires=[
        "paddlepaddle>=3.1",
        "numpy>=1.24",
        "safetensors>=0.4",
        "tokenizers>=0.21",  # DecodeStream (incremental detokenization)
        "huggingface_hub>=0.23",  # the local cache lookup (model_path.py), offline
        "jinja2>=3.1",
        "tqdm>=4.60",
        "fastapi>=0.110",
        "pydantic>=2.5",  # strict request validation (server/protocol.py)
        "uvicorn>=0.27",
        # uvicorn's C HTTP parser and event loop (what uvicorn[standard] adds, without its file
        # watcher): a request reaches its handler in ~1 ms instead of ~3 ms (docs/speed.md)
        "httptools>=0.6",
        "uvloop>=0.19; sys_platform != 'win32'",
        "prometheus_client>=0.20",
    ],
    extras_require={
        # torch is pinned: an unpinned torch pulls a CUDA build of several GB on CPU machines.
        "torch": ["torch==2.13.0"],
        # xgrammar: structured output (response_format json_*, forced tool_choice); it needs
        # torch, pinned here for the same reason.
        "structured": ["xgrammar>=0.2.9", "torch==2.13.0"],
        # serve: the official openai client the README's examples (and users' scripts) use.
        "serve": ["openai>=1.30"],
        # triton: its CPU interpreter runs the GPU kernels in the tests (tests/test_triton_kernels.py).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "torch==2.13.0", "transformers>=5.0", "triton==3.6.0",
                 "openai>=1.30", "httpx>=0.27", "xgrammar>=0.2.9", "jsonschema>=4.0",
                 # aiohttp: bench_serve's client (bench/bench_serve.py), run by the server tests.
                 "aiohttp>=3.9",
                 # lm-evaluation-harness against the tiny server (tests/test_lm_eval.py); pinned:
                 # its OpenAI-API client and result layout change between releases.
                 "lm_eval[api]==0.4.13"],
        "gpu": ["flashinfer-python>=0.7", "triton>=3.4"],
    },
    data_files=[("share/glm_fused/configs", [str(p) for p in sorted(Path("configs").glob("*.json"))])],
    entry_points={"console_scripts": [
        "glm-fused-serve=glm_fused.cli.serve:main",
        "glm-fused-generate=glm_fused.cli.generate:main",
        "glm-fused-logit-diff=glm_fused.cli.logit_diff:main",
    ]},
)
