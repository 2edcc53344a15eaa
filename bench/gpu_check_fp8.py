"""The FP8 section of bench/gpu_check.py: zerotrain's FP8 linears through
torch._scaled_mm on one GPU (with --dry-run: on the CPU, to test this script).

1. the path: `resolve_matmul("auto", ...)` picks `scaled_mm` for FP8 operands;
2. one large linear layer, forward + backward: FP8 (tensorwise) vs bf16, TFLOP/s and
   the output's relative error;
3. a small GPT trained from the same weights on the same batches, bf16 vs FP8 linears:
   both must learn, and end near each other.
Writes <out>/fp8.json: {"ok": true, "rows": [{check, status, detail}]}.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
from pathlib import Path

import torch
from torch import nn


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def layer_speed(dev: torch.device, d: int, tokens: int, recipe) -> dict:
    from zerotrain.numerics.fp8_linear import Fp8Linear

    torch.manual_seed(0)
    lin = nn.Linear(d, d, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(copy.deepcopy(lin), recipe)
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
    out = {}
    for name, layer in (("bf16", lin), ("fp8", fp8)):
        xi = x.clone().requires_grad_(True)
        times = []
        for i in range(8):
            _sync(dev)
            t = time.perf_counter()
            y = layer(xi)
            y.float().sum().backward()
            _sync(dev)
            if i >= 3:
                times.append(time.perf_counter() - t)
        out[name] = {"s": sorted(times)[len(times) // 2], "y": y.detach().float()}
    flops = 3 * 2 * tokens * d * d
    err = float((out["fp8"]["y"] - out["bf16"]["y"]).norm() / out["bf16"]["y"].norm())
    return {"bf16_tflops": flops / out["bf16"]["s"] / 1e12,
            "fp8_tflops": flops / out["fp8"]["s"] / 1e12, "rel_err": err}


def train_pair(dev: torch.device, recipe, steps: int, width: int = 256) -> dict:
    from zerotrain.config import ModelConfig
    from zerotrain.models import plan_for
    from zerotrain.models.gpt import GPT
    from zerotrain.numerics.fp8_linear import convert_to_fp8

    torch.manual_seed(0)
    base = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=width, block_size=128, bias=False))
    base = base.to(dev, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (8, 129), generator=g) for _ in range(4)]
    losses = {}
    for name in ("bf16", "fp8"):
        model = copy.deepcopy(base)
        if name == "fp8":
            convert_to_fp8(model, plan_for(model), recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        hist = []
        for s in range(steps):
            batch = data[s % len(data)].to(dev)
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist.append(float(loss.detach()))
        losses[name] = hist
    return losses


def checks(dev: torch.device, dry: bool) -> list[dict]:
    from zerotrain.numerics.fp8 import FP8Recipe
    from zerotrain.numerics.fp8_mm import resolve_matmul

    rows = []
    a8 = torch.randn(64, 64, device=dev).to(torch.float8_e4m3fn)
    b8 = torch.randn(64, 64, device=dev).to(torch.float8_e4m3fn).t()
    path = resolve_matmul("scaled_mm" if dry else "auto", a8, b8, False)
    rows.append({"check": "matmul path for FP8 operands", "detail": path,
                 "status": "PASS" if path == "scaled_mm" else "FAIL"})
    recipe = FP8Recipe(scaling="tensorwise", matmul="scaled_mm")
    d, tokens = (128, 64) if dry else (8192, 8192)
    r = layer_speed(dev, d, tokens, recipe)
    rows.append({"check": f"linear {d}x{d}, {tokens} tokens, fwd+bwd", "status": (
        "PASS" if r["rel_err"] < 0.1 else "FAIL"), "detail": (
        f"bf16 {r['bf16_tflops']:.1f} TFLOP/s, FP8 {r['fp8_tflops']:.1f} TFLOP/s "
        f"({r['fp8_tflops'] / r['bf16_tflops']:.2f}x); output rel. error {r['rel_err']:.3f}")})
    steps, width = (4, 64) if dry else (60, 256)
    losses = train_pair(dev, recipe, steps, width)
    b, f = losses["bf16"], losses["fp8"]
    learned = f[-1] < f[0] - 0.5 and b[-1] < b[0] - 0.5
    rows.append({"check": f"GPT 2x{width}, {steps} steps, bf16 vs FP8 linears",
                 "status": "PASS" if (learned or dry) and abs(f[-1] - b[-1]) < 0.25 * b[0]
                 else "FAIL",
                 "detail": f"loss bf16 {b[0]:.3f} -> {b[-1]:.3f}, FP8 {f[0]:.3f} -> {f[-1]:.3f}"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    try:
        result = {"ok": True, "rows": checks(dev, args.dry_run)}
    except BaseException as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    (Path(args.out) / "fp8.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
