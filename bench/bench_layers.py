"""Per-layer benchmark: one decoder layer of the torch backend against transformers, side by side.

In one process, on one device, with the same weights in both:

1. the machine's copy bandwidth (a large device-to-device copy; bytes read + written) and
   its dense matrix rate in the compute dtype (a square matmul);
2. for each layer kind (the MoE layer and the dense layer of GLM-4.5-Air, real sizes, random
   weights), prefill of ``--prefill`` tokens and decode at each ``--decode-batches`` batch
   size after the first ``--context`` cached tokens (batch 1 also after the others), for the
   project's layer at TP 1 in several variants (``OURS`` below: the serving path with Triton
   kernels and a CUDA graph for decode, the same without the graph, the classic layout, and
   the first version) and for transformers' ``Glm4MoeDecoderLayer`` (eager PyTorch; its
   experts both as its per-expert loop and as its ``grouped_mm`` kernel);
3. each time as a ratio to the step's floor: ``max(bytes / bandwidth, flop / matrix rate)``.
   Bytes are what the step must read at least once: attention and norm weights, the router,
   the experts the router actually chose for this batch (counted from the router's output),
   the shared expert or dense MLP, and the KV cache of the context. FLOP are the matmuls
   (2 per multiply-add), causal attention counted as half the square. ``ours-fp8`` (the
   serving path with fp8 weights: the same layer's weights quantized per row) has its own
   floor: its Linear weights at 1 byte each (plus a 4-byte scale per row), its FLOP at the
   machine's fp8 matrix rate (``torch._scaled_mm``).

Also checks that every variant computes what transformers' eager layer computes (max relative
difference of the residual stream after the layer), so a fast wrong layer cannot pass for a
fast one. ``ours-fp8`` is compared with transformers' layer holding the weights it multiplies
by (its codes times their scales), so that its error is the fp8 maths', not the weights'
rounding; its distance to the unquantized layer is reported beside (``vs_unquantized_reference``).

``python scripts/bench_layers.py`` (defaults: GPU, bf16, prefill 2048, decode 1/8/32/64 at
context 512, batch 1 also at 256 and 4096); ``--device cpu --config configs/glm-4.5-air-tiny.json --prefill 64 --matmul-n 256 --copy-mib 16
...`` runs the same code small on a CPU (the default 8192-wide matmul that measures the
matrix rate would take minutes there), the Triton kernels too under ``TRITON_INTERPRET=1``
(``--dtype float32``; the interpreter has no bf16 arithmetic). ``--json OUT`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

from bench.common import (AIR_CONFIG, copy_bandwidth, graphed, int_list, load_config, matmul_rate, name_list,
                          text_table, time_ms, torch_device, write_json)
from glm_fused.errors import UserError

IMPLS = ("ours", "ours-eager", "ours-unfused", "ours-v0", "ours-fp8", "hf-eager", "hf-grouped_mm")
# What each of the project's variants runs: (fused layout, Triton kernels, CUDA graph for decode).
#   ours          the serving path: Triton kernels, decode replayed from a CUDA graph
#   ours-eager    the same kernels launched op by op
#   ours-unfused  as ours, classic layout (plain add + RMSNorm): the TP=1 fused path must cost no more
#   ours-v0       the first version: eager PyTorch ops, a Python loop over experts (no Triton, no graph)
#   ours-fp8      as ours, with fp8 weights (fp8 GEMMs, the fp8 fused MoE); its own floor (1 byte per weight)
OURS = {"ours": (True, True, True), "ours-eager": (True, True, False), "ours-unfused": (False, True, True),
        "ours-v0": (True, False, False), "ours-fp8": ("fp8", True, True)}
# transformers' experts implementation per variant ("eager" = its own per-expert loop).
HF_EXPERTS = {"hf-eager": "eager", "hf-grouped_mm": "grouped_mm"}
REFERENCE = "hf-eager"  # every variant's output is compared with this one


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_layers.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=AIR_CONFIG,
                   help="model config.json (default: GLM-4.5-Air's real sizes)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--layers", default="moe,dense", help="layer kinds, in order (moe, dense)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"what to time ({', '.join(IMPLS)})")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (one sequence; 0 = skip)")
    p.add_argument("--decode-batches", type=int_list, default=[1, 8, 32, 64], help="decode batch sizes (1,8,32,64)")
    p.add_argument("--context", type=int_list, default=[512, 256, 4096],
                   help="cached tokens per sequence in decode: every batch at the first, batch 1 also at "
                        "the others (512,256,4096)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed calls per decode case (prefill: half)")
    p.add_argument("--copy-mib", type=int, default=2048, help="buffer size of the bandwidth copy (MiB)")
    p.add_argument("--matmul-n", type=int, default=8192, help="n of the n x n x n matmul for the matrix rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also list the GPU kernels of one 'ours-eager' call per case, and of the fp8 layer's "
                        "with ours-fp8 (torch profiler)")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.layers = name_list(args.layers, ("moe", "dense"), "--layers")
        args.impls = name_list(args.impls, IMPLS, "--impls")
    except UserError as exc:
        p.error(str(exc))
    return args


# ---------------------------------------------------------------------------- configs
def hf_config(config, **overrides):
    """transformers' Glm4MoeConfig with the same values (transformers-5 form), sdpa attention."""
    import transformers

    raw = config.to_hf_dict(5)
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    raw.update(overrides)
    cfg = transformers.Glm4MoeConfig(**raw)
    cfg._attn_implementation = "sdpa"  # what the project's attention uses too
    return cfg


@contextlib.contextmanager
def default_dtype(dtype):
    """Build modules directly in ``dtype`` (no full-precision copy of 2 B parameters first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ---------------------------------------------------------------------------- the two layers
def build_ours(config, layer_idx: int, dtype, device, seed: int, fused: bool = True, fp8_from=None):
    """The project's decoder layer at TP 1 (fused or classic layout), random weights (see
    fill_random); ``fp8_from``: a layer whose weights this one takes, its Linears in fp8 (the
    quantization ``--quantization fp8`` applies at load)."""
    from glm_fused.checkpoint import fp8_parameters
    from glm_fused.quantization import Fp8Scheme, module_of
    from glm_fused.sharding import TPShard
    from glm_fused.torch_backend import LAYERS, OPS
    from glm_fused.torch_backend.dist import TPComm

    comm = TPComm(0, 1)
    prefix = f"layers.{layer_idx}."
    fp8 = frozenset(module_of(n).removeprefix(prefix) for n in fp8_parameters(config, Fp8Scheme("online"))
                    if n.startswith(prefix)) if fp8_from is not None else frozenset()
    with torch.device(device):
        rotary = LAYERS.RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                        config.rope_theta)
        layer = LAYERS.Glm4MoeDecoderLayer(config, layer_idx, TPShard(config, 0, 1), comm, fused, rotary,
                                           str(dtype).removeprefix("torch."), fp8)
    if fp8_from is None:
        fill_random(layer, config, seed)
        return layer.eval()
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for name, p in fp8_from.named_parameters():
            if params[name].dtype == torch.float8_e4m3fn:
                q = OPS.quantize_fp8(p)
                params[name].copy_(q.codes)
                params[f"{name}_scale"].copy_(q.scale)
            else:
                params[name].copy_(p)
    return layer.eval()


@torch.no_grad()
def dequantized(fp8_layer: torch.nn.Module, like: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``like`` (the bf16 layer) holding ``fp8_layer``'s weights as it multiplies by them:
    each fp8 Linear's codes times its row scales, rounded to the model dtype."""
    import copy

    from glm_fused.model.ops import Fp8Weight
    from glm_fused.torch_backend import OPS

    out = copy.deepcopy(like)
    fp8 = dict(fp8_layer.named_parameters())
    for name, p in out.named_parameters():
        if fp8[name].dtype == torch.float8_e4m3fn:
            p.copy_(OPS.dequantize_fp8(Fp8Weight(fp8[name], fp8[f"{name}_scale"]), str(p.dtype).removeprefix("torch.")))
    return out


@torch.no_grad()
def fill_random(module: torch.nn.Module, config, seed: int, std: float = 0.02) -> None:
    """Random weights that make every piece matter: norms ``1 + 0.2 N(0,1)`` (ones would hide a
    misplaced norm), biases ``N(0, 0.05)``, a router whose logits spread (std 2.4) so the choice
    of experts depends on the token, a selection bias ``0.2 U(0,1)``; the rest ``N(0, std)``."""
    for i, (name, p) in enumerate(module.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, device=p.device))
        elif name.endswith("gate.e_score_correction_bias"):
            p.copy_(0.2 * torch.rand(p.shape, generator=g, device=p.device))
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 2.4 / config.hidden_size ** 0.5, generator=g)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.05, generator=g)
        else:
            p.normal_(0.0, std, generator=g)


def hf_state_from_ours(ours: torch.nn.Module, config, layer_idx: int, hf_keys: set[str]) -> dict[str, torch.Tensor]:
    """transformers' names -> our tensors (views), for decoder layer ``layer_idx`` at TP 1: the
    checkpoint loader's plan (``glm_fused.checkpoint.load_plan``) run backwards, so the names
    and the q/k/v, gate/up and expert layouts are the loader's own. ``hf_keys`` (the layer's
    state_dict names) choose per-expert or stacked experts, as a checkpoint's names do."""
    from glm_fused.checkpoint import load_plan
    from glm_fused.sharding import TPShard

    src, dst = f"model.layers.{layer_idx}.", f"layers.{layer_idx}."
    plan, full = load_plan(config, TPShard(config, 0, 1), {src + k for k in hf_keys})
    ours_params = dict(ours.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, p in plan.items():
        if not name.startswith(dst):
            continue
        tensor = ours_params[name.removeprefix(dst)]
        for r in p.parts:  # checkpoint slice r.name[r.index] is our tensor[r.dst]
            piece = tensor[r.dst] if r.dst else tensor
            key = r.name.removeprefix(src)
            if tuple(piece.shape) == tuple(full[r.name]):
                out[key] = piece
            else:  # a piece of one checkpoint tensor (stacked experts' gate and up rows)
                out.setdefault(key, tensor.new_empty(full[r.name]))[r.index] = piece
    return out


@torch.no_grad()
def build_hf(config, layer_idx: int, ours: torch.nn.Module, dtype, device):
    """transformers' decoder layer (and its rotary embedding) holding exactly our layer's weights."""
    from transformers.models.glm4_moe import modeling_glm4_moe as hfm

    cfg = hf_config(config)
    with torch.device(device):
        with default_dtype(dtype):
            layer = hfm.Glm4MoeDecoderLayer(cfg, layer_idx)
        rotary = hfm.Glm4MoeRotaryEmbedding(config=cfg)
    if config.is_moe_layer(layer_idx):
        layer.mlp.gate.float()  # fp32 router, as transformers keeps it when loading a checkpoint
    target = layer.state_dict()
    source = hf_state_from_ours(ours, config, layer_idx, set(target))
    missing, extra = sorted(set(target) - set(source)), sorted(set(source) - set(target))
    if missing or extra:
        raise RuntimeError(f"weight mapping to transformers' layer: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in source.items():
        if tuple(target[name].shape) != tuple(t.shape):
            raise RuntimeError(f"{name}: transformers {list(target[name].shape)} vs ours {list(t.shape)}")
        target[name].copy_(t)
    return layer.eval(), rotary, cfg


def _cache_keyword() -> str:
    """transformers renamed the decoder layer's ``past_key_values`` to ``cache`` (5.2x)."""
    import inspect

    from transformers.models.glm4_moe import modeling_glm4_moe as hfm

    params = inspect.signature(hfm.Glm4MoeDecoderLayer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# ---------------------------------------------------------------------------- the floor
def layer_cost(config, moe: bool, *, tokens: int, seqs: int, context: int, experts_hit: int,
               itemsize: int, fp8: bool = False) -> dict:
    """Least bytes one step must move and the matmul FLOP it must do, for one layer at TP 1.

    ``tokens`` new tokens in ``seqs`` sequences, each after ``context`` cached tokens (prefill:
    one sequence, context 0, causal attention over its own tokens). ``itemsize``: bytes of an
    activation, KV entry and norm weight; ``fp8``: Linear weights at 1 byte, with a float32
    scale per row (the router stays fp32)."""
    c = config
    H, D, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    w_bytes = 1 if fp8 else itemsize

    def linear(rows: int, cols: int) -> int:  # bytes of one Linear weight
        return rows * cols * w_bytes + (rows * 4 if fp8 else 0)

    qkv_out = (nh + 2 * nkv) * D
    attn_params = qkv_out * H + H * nh * D
    small = 2 * H + (qkv_out if c.attention_bias else 0) + (2 * D if c.use_qk_norm else 0)
    weight_bytes = linear(qkv_out, H) + linear(H, nh * D) + small * itemsize
    flop = 2 * tokens * attn_params
    keys = context + tokens // seqs  # keys each sequence attends to (its new ones included)
    if context == 0 and tokens > seqs:  # causal prefill: on average half the square
        flop += 2 * 2 * nh * D * tokens * (tokens // seqs + 1) // 2
    else:
        flop += 2 * 2 * nh * D * tokens * keys
    kv_bytes = seqs * keys * nkv * D * 2 * itemsize
    act_bytes = 2 * tokens * H * itemsize  # layer input in, stream out
    if moe:
        E, Im, Is, k = c.n_routed_experts, c.moe_intermediate_size, c.shared_intermediate_size, c.num_experts_per_tok
        weight_bytes += E * H * 4 + E * 4                                    # fp32 router + correction bias
        weight_bytes += experts_hit * (linear(2 * Im, H) + linear(H, Im))    # only the experts chosen
        weight_bytes += linear(2 * Is, H) + linear(H, Is)                    # shared expert
        flop += 2 * tokens * (E * H + k * 3 * Im * H + 3 * Is * H)
    else:
        weight_bytes += linear(2 * c.intermediate_size, H) + linear(H, c.intermediate_size)
        flop += 2 * tokens * 3 * c.intermediate_size * H
    return {"bytes": weight_bytes + kv_bytes + act_bytes, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "flop": flop}


# ---------------------------------------------------------------------------- one case
def _rel(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    diff = (out - ref).abs()
    rows = diff.amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return {"max_rel": float(diff.max() / ref.abs().max().clamp_min(1e-30)),
            "row_rel_p50": float(rows.median()), "row_rel_p99": float(torch.quantile(rows, 0.99)),
            "nan": bool(torch.isnan(out).any())}


@contextlib.contextmanager
def triton_kernels(on: bool):
    from glm_fused.torch_backend import kernels

    previous = kernels.set_enabled(on)
    try:
        yield
    finally:
        kernels.set_enabled(previous)


def run_case(config, kind: str, step: str, layers: dict, hf, rotary, args, device, dtype) -> dict:
    """Time one (layer, step) for every implementation; compare each output with transformers'."""
    from glm_fused.batch import ForwardBatch, slot_block_tables
    from glm_fused.model.attention import AttentionMetadata
    from glm_fused.torch_backend import OPS

    ours = layers[True]
    layer_idx = config.first_k_dense_replace if kind == "moe" else 0
    H, D, nkv = config.hidden_size, config.head_dim, ours.self_attn.num_kv_heads
    g = torch.Generator(device=device).manual_seed(args.seed + 17)
    page = 16  # the engine's default KV-cache block size
    if step == "prefill":
        T, B, C = args.prefill, 1, 0
        cache_len = T
        tables = slot_block_tables([0], -(-cache_len // page))
        batch = ForwardBatch.prefill([[0] * T], tables)
        hidden = torch.randn(T, H, generator=g, device=device).to(dtype)
        hf_x = hidden[None]
        position_ids = torch.arange(T, device=device)[None]
    else:
        B, C = (int(x) for x in step.removeprefix("decode-b").split("-c"))
        T = B
        cache_len = C + 1
        tables = slot_block_tables(range(B), -(-cache_len // page))
        batch = ForwardBatch.decode([0] * B, [C] * B, tables)
        hidden = torch.randn(B, H, generator=g, device=device).to(dtype)
        hf_x = hidden[:, None, :]
        position_ids = torch.full((B, 1), C, device=device)
    positions = torch.as_tensor(batch.positions, device=device)

    def metadata(use_triton: bool):  # the plain ops and the kernels read different metadata
        with triton_kernels(use_triton):
            return AttentionMetadata.from_batch(batch, OPS, like=positions, block_size=page)

    metas = {on: metadata(on) for on in (False, True)}
    # Each sequence's blocks back to back: [B, positions] for transformers' cache, the same
    # memory as [blocks, page] for ours.
    width = tables.shape[1] * page
    k_seq = torch.randn(B, width, nkv, D, generator=g, device=device).to(dtype)
    v_seq = torch.randn(B, width, nkv, D, generator=g, device=device).to(dtype)
    k_cache, v_cache = k_seq.view(-1, page, nkv, D), v_seq.view(-1, page, nkv, D)
    kw = _cache_keyword() if hf is not None else None

    def hf_cache():
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        if C:  # the same context the project's cache holds, [B, kv_heads, C, D]
            cache.update(k_seq[:, :C].transpose(1, 2).contiguous(), v_seq[:, :C].transpose(1, 2).contiguous(),
                         layer_idx)
        return cache

    pe = rotary(hf_x, position_ids) if rotary is not None else None
    hit = {}

    def record(moe, inputs):  # the MoE's input; its choice is OPS.route's on the router's logits
        gate = moe.gate
        _, ids = OPS.route(OPS.router_logits(inputs[0], gate.weight), gate.e_score_correction_bias, gate.routing)
        hit["n"] = int(torch.unique(ids).numel())

    handle = ours.mlp.register_forward_pre_hook(record) if kind == "moe" else None
    with torch.inference_mode(), triton_kernels(False):
        ours(positions, hidden, None, metas[False], (k_cache, v_cache))
    if handle is not None:
        handle.remove()
    res = {"layer": kind, "step": step, "tokens": T, "seqs": B, "context": C,
           "experts_hit": hit.get("n"), "impls": {}}
    cost = layer_cost(config, kind == "moe", tokens=T, seqs=B, context=C, experts_hit=hit.get("n") or 0,
                      itemsize=hidden.element_size())
    res.update(cost)
    bw, rate = args.bandwidth, args.matrix_rate
    res["floor_ms_bytes"] = cost["bytes"] / bw * 1e3
    res["floor_ms_flop"] = cost["flop"] / rate * 1e3
    res["floor_ms"] = max(res["floor_ms_bytes"], res["floor_ms_flop"])
    res["bound"] = "HBM" if res["floor_ms_bytes"] >= res["floor_ms_flop"] else "compute"
    if "fp8" in layers:  # the fp8 layer's own floor
        fp8 = layer_cost(config, kind == "moe", tokens=T, seqs=B, context=C, experts_hit=hit.get("n") or 0,
                         itemsize=hidden.element_size(), fp8=True)
        res["fp8_bytes"] = fp8["bytes"]
        res["fp8_floor_ms"] = max(fp8["bytes"] / bw, fp8["flop"] / args.fp8_matrix_rate) * 1e3
    iters = args.iters if step != "prefill" else max(2, args.iters // 2)

    def hf_forward(layer, cache):  # a transformers layer on the step's input, over ``cache``
        return layer(hf_x, attention_mask=None, position_ids=position_ids, use_cache=True, position_embeddings=pe,
                     **{kw: cache})

    outputs = {}
    fp8_reference = None
    if "fp8-reference" in layers and "ours-fp8" in args.impls:
        layers["fp8-reference"].mlp.config._experts_implementation = "eager"
        with torch.inference_mode():
            fp8_reference = hf_forward(layers["fp8-reference"], hf_cache()).reshape(T, H)
    # transformers first: its eager output is the reference every variant is compared with
    order = [i for i in args.impls if i in HF_EXPERTS] + [i for i in args.impls if i in OURS]
    for impl in order:
        entry = {}
        try:
            with torch.inference_mode():
                if impl in OURS:
                    fused, use_triton, graph = OURS[impl]
                    layer = layers[fused]
                    with triton_kernels(use_triton):
                        def fn(layer=layer, meta=metas[use_triton]):
                            out, residual = layer(positions, hidden, None, meta, (k_cache, v_cache))
                            return out + residual  # the residual stream after the layer
                        if graph and step != "prefill" and device.type == "cuda":
                            fn = graphed(fn, device)
                            entry["cuda_graph"] = True
                        outputs[impl] = fn().clone()
                        entry["ms"] = time_ms(fn, device, args.warmup, iters)
                else:
                    hf.mlp.config._experts_implementation = HF_EXPERTS[impl] if kind == "moe" else "eager"
                    outputs[impl] = hf_forward(hf, hf_cache()).reshape(T, H)
                    timed_cache = hf_cache()  # grows by one token per decode call: < 3% of the context

                    def fn(cache=timed_cache):
                        return hf_forward(hf, cache if step != "prefill" else hf_cache())  # prefill: a fresh cache
                    entry["ms"] = time_ms(fn, device, args.warmup, iters)
                entry["x_floor"] = entry["ms"] / res["fp8_floor_ms" if impl == "ours-fp8" else "floor_ms"]
                if impl == "ours-fp8" and fp8_reference is not None:
                    # against transformers on the same (rounded) weights; the rounding's own cost beside it
                    entry["vs_reference"] = _rel(outputs[impl], fp8_reference)
                    if REFERENCE in outputs:
                        entry["vs_unquantized_reference"] = _rel(outputs[impl], outputs[REFERENCE])
                elif impl != REFERENCE and REFERENCE in outputs:
                    entry["vs_reference"] = _rel(outputs[impl], outputs[REFERENCE])
        except Exception as exc:  # one implementation failing must not hide the others
            entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        res["impls"][impl] = entry
    res["impls"] = {i: res["impls"][i] for i in args.impls if i in res["impls"]}  # the order asked for
    if args.profile and device.type == "cuda":
        with torch.inference_mode(), triton_kernels(True):
            res["kernels"] = profile_kernels(
                lambda: layers[True](positions, hidden, None, metas[True], (k_cache, v_cache)))
            if "fp8" in layers and "ours-fp8" in args.impls:
                res["kernels_fp8"] = profile_kernels(
                    lambda: layers["fp8"](positions, hidden, None, metas[True], (k_cache, v_cache)))
    ours_ms = res["impls"].get("ours", {}).get("ms")
    for impl, entry in res["impls"].items():
        if impl != "ours" and ours_ms and entry.get("ms"):
            entry["ours_speedup"] = entry["ms"] / ours_ms
    return res


def fp8_matmul_rate(device, n: int, iters: int = 20) -> float:
    """FLOP per second of an n x n x n fp8 GEMM with row-wise scales (``torch._scaled_mm``)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, generator=g, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    ms = time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device,
                 warmup=3, iters=iters)
    return 2 * n ** 3 / (ms / 1e3)


def profile_kernels(fn, calls: int = 3, top: int = 14) -> list[dict]:
    """GPU kernels of ``fn`` (warm), heaviest first: name, microseconds per call, launches per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:70], "us_per_call": e.device_time_total / calls, "launches": e.count / calls}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["us_per_call"])
    total = sum(r["us_per_call"] for r in rows)
    return [{"kernel": "(all kernels)", "us_per_call": total, "launches": sum(r["launches"] for r in rows)}] + rows[:top]


def decode_steps(batches: list[int], contexts: list[int]) -> list[str]:
    """Every batch at the first context; batch 1 also at the other contexts."""
    steps = [f"decode-b{b}-c{contexts[0]}" for b in batches]
    return steps + [f"decode-b1-c{c}" for c in contexts[1:]]


# ---------------------------------------------------------------------------- driver
def run(args) -> dict:
    """Measure the machine, then every (layer, step) case; print the table; return every figure."""
    device = torch_device(args.device)
    dtype = getattr(torch, args.dtype)
    from glm_fused.torch_backend import kernels

    if device.type == "cpu" and kernels.interpreting():  # TRITON_INTERPRET=1: the kernels on CPU tensors
        kernels.interpreter_numpy2_fix()
    config = load_config(args.config, num_hidden_layers=max(2, 1 + load_config(args.config).first_k_dense_replace))
    out = {"config": str(args.config), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": args.dtype, "torch": torch.__version__, "prefill": args.prefill, "context": args.context,
           "decode_batches": args.decode_batches, "warmup": args.warmup, "iters": args.iters}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        args.impls = [i for i in args.impls if i in OURS]
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    with triton_kernels(True):  # False: the kernel variants ran the plain ops (no Triton for this device)
        out["triton_kernels"] = kernels.enabled(torch.empty(0, device=device))
    args.bandwidth = copy_bandwidth(device, args.copy_mib)
    args.matrix_rate = matmul_rate(device, args.matmul_n, dtype)
    out["copy_bandwidth_GBps"] = args.bandwidth / 1e9
    out["matrix_TFLOPs"] = args.matrix_rate / 1e12
    if "ours-fp8" in args.impls:
        args.fp8_matrix_rate = fp8_matmul_rate(device, args.matmul_n) if device.type == "cuda" else args.matrix_rate
        out["fp8_matrix_TFLOPs"] = args.fp8_matrix_rate / 1e12
    fp8_rate = f", fp8 {out['fp8_matrix_TFLOPs']:.1f}" if "fp8_matrix_TFLOPs" in out else ""
    print(f"device {out['device']}, {args.dtype}: copy bandwidth {args.bandwidth / 1e9:.0f} GB/s "
          f"(read + write, {args.copy_mib} MiB buffers), matmul {args.matrix_rate / 1e12:.1f}{fp8_rate} TFLOP/s "
          f"({args.matmul_n}^3)", flush=True)
    steps = (["prefill"] if args.prefill else []) + decode_steps(args.decode_batches, args.context)
    cases = []
    for kind in args.layers:
        if kind == "dense" and config.first_k_dense_replace == 0:
            continue
        layer_idx = config.first_k_dense_replace if kind == "moe" else 0
        t0 = time.perf_counter()
        layers = {True: build_ours(config, layer_idx, dtype, device, args.seed)}
        if "ours-unfused" in args.impls:  # same seed, same parameter order: the same weights
            layers[False] = build_ours(config, layer_idx, dtype, device, args.seed, fused=False)
        if "ours-fp8" in args.impls:  # the same weights, quantized per row
            layers["fp8"] = build_ours(config, layer_idx, dtype, device, args.seed, fp8_from=layers[True])
        hf = rotary = None
        if any(i in HF_EXPERTS for i in args.impls):
            hf, rotary, _ = build_hf(config, layer_idx, layers[True], dtype, device)
            if "fp8" in layers:  # ours-fp8's reference: transformers on the weights the fp8 layer holds
                layers["fp8-reference"], _, _ = build_hf(config, layer_idx, dequantized(layers["fp8"], layers[True]),
                                                         dtype, device)
        print(f"built the {kind} layer (index {layer_idx}) in {time.perf_counter() - t0:.1f} s", flush=True)
        for step in steps:
            case = run_case(config, kind, step, layers, hf, rotary, args, device, dtype)
            cases.append(case)
            _print_case(case)
        del layers, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["cases"] = cases
    print()
    print_table(out)
    if args.json:
        write_json(args.json, out)
    return out


def _print_case(case: dict) -> None:
    parts = []
    for impl, e in case["impls"].items():
        parts.append(f"{impl} {e['ms']:.3f} ms" if "ms" in e else f"{impl} FAILED ({e['error'][:80]})")
    print(f"  {case['layer']:5} {case['step']:15} floor {case['floor_ms']:.3f} ms: " + ", ".join(parts), flush=True)
    for key in ("kernels", "kernels_fp8"):
        if key in case:
            print(f"    {'bf16' if key == 'kernels' else 'fp8'} kernels of one eager call:", flush=True)
        for k in case.get(key, []):
            print(f"      {k['us_per_call']:8.1f} us  x{k['launches']:<5g} {k['kernel']}", flush=True)


def print_table(out: dict) -> None:
    impls = []
    for case in out["cases"]:
        impls += [i for i in case["impls"] if i not in impls]
    fp8 = any("fp8_floor_ms" in c for c in out["cases"])
    header = ["layer", "step", "tokens", "experts hit", "floor ms", "bound"] + (["fp8 floor ms"] if fp8 else [])
    for impl in impls:
        header += [f"{impl} ms", "x floor"]
    header += [f"ours vs {i}" for i in impls if i != "ours"]
    header += [f"{i} max rel" for i in impls if i != REFERENCE]
    rows = []
    for c in out["cases"]:
        row = [c["layer"], c["step"], c["tokens"], "-" if c["experts_hit"] is None else c["experts_hit"],
               f"{c['floor_ms']:.3f}", c["bound"]] + ([f"{c['fp8_floor_ms']:.3f}"] if fp8 else [])
        for impl in impls:
            e = c["impls"].get(impl, {})
            row += [f"{e['ms']:.3f}", f"{e['x_floor']:.2f}"] if "ms" in e else ["failed", "-"]
        row += [f"{c['impls'][i]['ours_speedup']:.2f}x" if "ours_speedup" in c["impls"].get(i, {}) else "-"
                for i in impls if i != "ours"]
        row += [f"{c['impls'][i]['vs_reference']['max_rel']:.1e}" if "vs_reference" in c["impls"].get(i, {})
                else "-" for i in impls if i != REFERENCE]
        rows.append(row)
    print(text_table(header, rows))
    print(f"floor = max(bytes / {out['copy_bandwidth_GBps']:.0f} GB/s, FLOP / {out['matrix_TFLOPs']:.0f} TFLOP/s); "
          "'ours vs X' = X ms / ours ms (above 1: ours is faster); max rel = max|X - transformers eager| / "
          "max|transformers eager| of the layer's output stream. ours = Triton kernels + CUDA graph (decode), "
          "ours-eager = same kernels without the graph, ours-unfused = classic layout, ours-v0 = the first "
          "version (eager PyTorch, expert loop)" + ("; ours-fp8 = ours with fp8 weights, its x floor against the fp8 "
                                                    "floor (weights at 1 byte, fp8 matrix rate), its max rel against "
                                                    "transformers holding the rounded weights" if fp8 else ""),
          flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
