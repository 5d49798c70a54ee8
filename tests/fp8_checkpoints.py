"""FP8 checkpoints made from a bf16/fp32 one, as the exporters in the wild write them, and the
same checkpoint dequantized to fp32: the reference an fp8 load is compared with.

Written with torch's own e4m3 (``torch.float8_e4m3fn``) and safetensors, independently of
``glm_fused.quantization``. Layouts:

* ``channel``: compressed-tensors ``float-quantized``, one scale per output row
  (``<module>.weight_scale``, ``[out, 1]``; stacked experts ``<name>_scale`` ``[E, 2I]``), routers
  and ``lm_head`` in its ``ignore`` list (as zai-org/GLM-4.5-Air-FP8);
* ``block``: ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-style):
  ``<module>.weight_scale_inv`` per block, the stacked experts quantized as one tensor, so a
  block may straddle the gate and up halves.

``fused=True`` writes transformers-5 stacked experts (``mlp.experts.gate_up_proj``) instead of
per-expert tensors. The MTP layer is quantized too (the loader skips it).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?"
                    r"(gate|up|down)_proj)\.weight$")
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    *lead, rows, cols = w.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(*lead, nr * bn, nc * bk)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.unflatten(-1, (nc, bk)).unflatten(-3, (nr, bn))  # [..., nr, bn, nc, bk]
    scale = blocks.abs().amax((-3, -1)).clamp_min(1e-12) / FP8_MAX     # [..., nr, nc]
    return (w.float() / expand(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers-5 ``experts.gate_up_proj [E, 2I, H]`` and ``down_proj``."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out


def _quantized(name: str) -> bool:
    return bool(LINEAR.match(name)) or name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def convert(src: Path, dst: Path, ref: Path | None, layout: str, fused: bool = False,
            block: tuple[int, int] = (48, 40), scale_dtype=torch.float32) -> None:
    """Write ``src`` quantized into ``dst`` (and, given ``ref``, its fp32 dequantized twin there)."""
    config = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    num_layers = config["num_hidden_layers"]
    for d in (dst, ref):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
                    shutil.copy(f, d / f.name)
    weight_map, ref_map = {}, {}
    for shard in shards:
        tensors = load_file(str(src / shard))
        if fused:
            tensors = _stack_experts(tensors)
        out, deq = {}, {}
        for name, t in tensors.items():
            if not _quantized(name):
                out[name] = deq[name] = t
                continue
            if layout == "channel":
                codes, scale = quantize_rows(t)
                stored = scale.to(scale_dtype)
                out[name] = codes
                # per-module [out, 1] as compressed-tensors writes it; stacked experts [E, out]
                out[name + "_scale"] = stored if fused and not name.endswith(".weight") else stored[..., None]
                deq[name] = codes.float() * stored.float()[..., None]
            else:
                codes, scale = quantize_blocks(t, block)
                stored = scale.to(scale_dtype)
                out[name], out[name + "_scale_inv"] = codes, stored
                deq[name] = codes.float() * expand(stored.float(), block, *t.shape[-2:])
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
        if ref is not None:
            save_file({k: v.float().contiguous() for k, v in deq.items()}, str(ref / shard), metadata={"format": "pt"})
            ref_map.update({k: shard for k in deq})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if layout == "channel":
        quant = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True, "observer": None},
                "output_activations": None}},
            "ignore": ["lm_head", *[f"model.layers.{i}.mlp.gate" for i in range(config["first_k_dense_replace"],
                                                                                 num_layers + 1)]],
            "kv_cache_scheme": None}
    else:
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    if ref is not None:
        (ref / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": ref_map}))
        (ref / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2))


def rank_logits(args: dict) -> None:
    """Launcher worker: each checkpoint of ``args['checkpoints']`` (name -> directory) on this
    rank's ``ModelRunner`` (torch, CPU, fp32): a prefill of both prompts, then two decode steps;
    rank 0 writes ``args['out']/<name>.npy`` (rows of all steps, stacked)."""
    import sys

    import numpy as np

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from glm_fused.backends import get_backend
    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    backend = args.get("backend", "torch")
    rank, world = get_backend(backend).init_distributed()
    p0, p1 = args["prompts"]
    for name, ckpt in args["checkpoints"].items():
        settings = EngineArgs(model=ckpt, tp=world, backend=backend, device="cpu", dtype="float32", max_num_seqs=4,
                              max_model_len=64, max_num_batched_tokens=64,
                              quantization=args.get("quantization")).resolve()
        settings.num_gpu_blocks_override = settings.slot_blocks()  # one slot of max_model_len per sequence
        runner = ModelRunner(settings, settings.config(), tp_rank=rank, tp_size=world)
        tables = runner.slot_tables([0, 1])
        rows = [runner.forward(ForwardBatch.prefill([p0, p1], tables, all_logits=True))]
        for i in range(2):
            rows.append(runner.forward(ForwardBatch.decode([3 + i, 5 + i], [len(p0) + i, len(p1) + i], tables)))
        runner.close()
        if rank == 0:
            np.save(Path(args["out"]) / f"{name}.npy", np.concatenate(rows))
