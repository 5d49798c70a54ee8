"""What ``--model`` names: a checkpoint directory, the tiny default, or a local HF cache entry.

Resolution never touches the network: real checkpoints come from the user's disk or an
already-populated Hugging Face cache (looked up with ``huggingface_hub``, ``local_files_only``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from glm_fused.errors import UserError
from glm_fused.tiny import TINY_NAME, configs_dir, ensure_tiny_checkpoint

DEFAULT_ORG = "zai-org"
# Lower-cased repo name -> (canonical repo id, config shipped in configs/ for dummy weights).
KNOWN_MODELS = {
    "glm-4.5-air": ("zai-org/GLM-4.5-Air", "glm-4.5-air.json"),
    "glm-4.5-air-fp8": ("zai-org/GLM-4.5-Air-FP8", "glm-4.5-air-fp8.json"),  # compressed-tensors channel fp8
    "glm-4.5": ("zai-org/GLM-4.5", "glm-4.5.json"),
}
_REPO_ID = re.compile(r"^(?:(?P<org>[A-Za-z0-9][\w.-]*)/)?(?P<name>[A-Za-z0-9][\w.-]*)$")


@dataclass(frozen=True)
class ResolvedModel:
    """path: checkpoint directory, or None for random weights at config_path;
    name: what to call the model in output (the repo id, the tiny name, or the spec)."""

    path: Path | None
    config_path: Path
    name: str


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache the hub library itself would use."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _repo_id(spec: str) -> tuple[str, str] | None:
    """(org, name) for a repo-id-shaped spec; bare names belong to zai-org."""
    match = _REPO_ID.match(spec)
    if match is None:
        return None
    org, name = match.group("org") or DEFAULT_ORG, match.group("name")
    known = KNOWN_MODELS.get(name.lower())
    if known and org.lower() == DEFAULT_ORG:
        org, name = known[0].split("/")  # canonical spelling: the cache folder is case-sensitive
    return org, name


def _cached_snapshot(hub: Path, org: str, name: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of ``org/name`` at ``revision`` (a branch, tag or commit; default
    main) in the cache, found by ``huggingface_hub`` without touching the network; None if absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    folder = hub / f"models--{org}--{name}"
    if not folder.is_dir() and hub.is_dir():  # the hub is case-sensitive; users' spelling is not
        wanted = folder.name.lower()
        folder = next((p for p in hub.iterdir() if p.name.lower() == wanted and p.is_dir()), folder)
    if not folder.is_dir():
        return None
    repo_id = "/".join(folder.name.split("--", 2)[1:])
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    # A cache copied or edited by hand, which the hub library does not read (a ref with a
    # trailing newline, no refs/main): the ref as written, else (no revision asked) the newest
    # snapshot with a config.
    snapshots = folder / "snapshots"
    ref = folder / "refs" / (revision or "main")
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    if revision is not None:
        return None
    candidates = [p for p in snapshots.iterdir() if (p / "config.json").is_file()] if snapshots.is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def resolve_model(spec: str, *, load_format: str = "safetensors", revision: str | None = None) -> ResolvedModel:
    """Find the checkpoint (or, for load_format "dummy", just the config) that spec names;
    ``revision``: which snapshot of a Hugging Face cache entry (branch, tag or commit)."""
    spec = spec.strip()
    if not spec:
        raise UserError("--model is empty")
    where = Path(spec).expanduser()
    if revision is not None and (where.is_dir() or spec.lower() == TINY_NAME or _looks_like_path(spec)):
        raise UserError(f"--revision {revision}: it picks a snapshot of a Hugging Face cache entry; "
                        f"--model '{spec}' is not one")
    if where.is_dir():
        if not (where / "config.json").is_file():
            raise UserError(f"--model '{spec}': directory {where} has no config.json")
        return ResolvedModel(where, where / "config.json", spec.rstrip("/") or spec)
    if spec.lower() == TINY_NAME:
        path = ensure_tiny_checkpoint()
        return ResolvedModel(path, path / "config.json", TINY_NAME)
    if _looks_like_path(spec):
        raise UserError(f"--model '{spec}': no such directory")

    repo = _repo_id(spec)
    if repo is None:
        raise UserError(
            f"--model '{spec}': not a directory, not '{TINY_NAME}', and not a Hugging Face "
            "model name like zai-org/GLM-4.5-Air"
        )
    org, name = repo
    hub = hf_hub_cache()
    snapshot = _cached_snapshot(hub, org, name, revision)
    if snapshot is not None:
        if not (snapshot / "config.json").is_file():
            raise UserError(f"--model '{spec}': snapshot {snapshot} in the Hugging Face cache has no config.json")
        return ResolvedModel(snapshot, snapshot / "config.json", f"{org}/{name}")
    if revision is not None:
        raise UserError(f"--model '{spec}' --revision {revision}: no such snapshot of 'models--{org}--{name}' "
                        f"in the Hugging Face cache at {hub}")

    known = KNOWN_MODELS.get(name.lower()) if org.lower() == DEFAULT_ORG else None
    if known is not None and load_format == "dummy":
        return ResolvedModel(None, configs_dir() / known[1], known[0])
    hint = " (or --load-format dummy for random weights at its real config)" if known else ""
    raise UserError(
        f"--model '{spec}': not a directory with config.json, not '{TINY_NAME}', and no "
        f"'models--{org}--{name}' in the Hugging Face cache at {hub}{hint}"
    )
