"""The fp8 accuracy rule at real width: the fp8 model's distance to fp32 next to the bf16 model's.

One process, TP 1, GLM-4.5-Air's layer sizes cut to ``--layers`` layers (2-8: an fp32 copy must
fit beside them; the first stays dense). One set of random weights (bench_layers.fill_random:
routers whose choice depends on the token) drawn in fp32, then three models hold it:

* fp32: the weights as drawn - the reference;
* bf16: the weights rounded to bf16, the serving path in bf16;
* fp8: the weights quantized per row (what ``--quantization fp8`` does at load), fp8 GEMMs
  and the fp8 fused MoE with activations quantized per token.

Both lower-precision models round the same weights, so their errors compare what e4m3 and
bf16 cost (the issue's "same weights").

The same prompts (random token ids, one prefill each) through each; logits compared with the
fp32 model's (``glm_fused.metrics``). The rule, fixed before the first GPU run (issue: "FP8
weights"): the fp8 model's mean row error to fp32 (per row: max |diff| / max |fp32 logit|,
averaged) is at most ``--max-ratio`` (8) times the bf16 model's - e4m3 keeps 3 mantissa bits
where bf16 keeps 7 (16x coarser rounding), and a CPU simulation of random layers measured
4.7-6x; top-1 agreement of both with fp32 is reported beside it. Exit status 0 within the rule,
1 past it. (Measured on CPU before any GPU run, 2 layers at real width with 16 experts, the
fp8 kernels' maths emulated in torch: 9.1x with activations quantized per token, about 6.7x
for the weights alone: docs/fp8.md.)

``python scripts/fp8_accuracy.py`` (GPU, 4 layers); ``--device cpu --config
configs/glm-4.5-air-tiny.json`` runs the same code small (on CPU the fp8 model holds its weights
rounded through fp8 and computes in bf16: weight rounding only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import AIR_CONFIG, load_config, torch_device, write_json

MAX_RATIO = 8.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8_accuracy.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=AIR_CONFIG, help="model config.json (default: GLM-4.5-Air)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept (default 4; 2-8 fit one H200)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--prompts", type=int, default=4, help="prompts of random token ids (default 4)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-ratio", type=float, default=MAX_RATIO,
                   help=f"largest allowed fp8 / bf16 mean row error to fp32 (default {MAX_RATIO:g})")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p


def _logits(model, ids) -> np.ndarray:
    import torch

    with torch.inference_mode():
        out = model(ids)
    return out.float().reshape(-1, out.shape[-1]).cpu().numpy()


def run(args) -> dict:
    import torch

    from bench.bench_layers import fill_random
    from glm_fused import metrics
    from glm_fused.model.loader import copy_weights
    from glm_fused.torch_backend import LAYERS

    device = torch_device(args.device)
    config = load_config(args.config, num_hidden_layers=args.layers)
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, config.vocab_size, size=(args.prompts, args.prompt_len)).tolist()

    def build(dtype: str, quantization=None):
        with torch.device(device):
            return LAYERS.Glm4MoeForCausalLM(config, dtype=dtype, max_position=args.prompt_len,
                                             quantization=quantization).eval()

    t0 = time.perf_counter()
    master = build("float32")
    with torch.no_grad():
        fill_random(master, config, args.seed)
    logits = {"float32": _logits(master, ids)}
    for name, quantization in (("bfloat16", None), ("fp8", "fp8")):
        model = build("bfloat16", quantization)
        copy_weights(master, model)
        logits[name] = _logits(model, ids)
        held = "fp8 codes + row scales" if model.fp8_params else "bfloat16 values"
        print(f"{name}: {len(model.quantized)} weights fp8 by the scheme, held as {held}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref = logits.pop("float32")
    table = {name: metrics.compare_logits(ref, x) for name, x in logits.items()}
    ratio = table["fp8"]["mean_row_rel_diff"] / max(table["bfloat16"]["mean_row_rel_diff"], 1e-30)
    out = {"config": str(args.config), "layers": args.layers, "device": str(device),
           "prompts": args.prompts, "prompt_len": args.prompt_len, "seed": args.seed,
           "seconds": round(time.perf_counter() - t0, 1), "vs_fp32": table, "fp8_to_bf16_error_ratio": ratio,
           "max_ratio": args.max_ratio, "passed": bool(ratio <= args.max_ratio)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    print(f"{args.layers} layers of {args.config.name}, {args.prompts} x {args.prompt_len} tokens, against fp32 "
          f"on the same weights:")
    for name, m in table.items():
        print(f"  {name:9} mean row error {m['mean_row_rel_diff']:.3e}  max rel {m['max_rel_diff']:.3e}  "
              f"KL {m['kl_mean']:.3e}  top1 {m['top1_agreement']:.4f}  top5 {m['top5_agreement']:.4f}")
    verdict = "PASS" if out["passed"] else "FAIL"
    print(f"{verdict}: fp8 / bf16 mean row error {ratio:.2f} (limit {args.max_ratio:g})", flush=True)
    if args.json:
        write_json(args.json, out)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.layers:
        build_parser().error(f"--layers {args.layers}: must be at least 1")
    return 0 if run(args)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
