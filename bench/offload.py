"""ZeRO-Offload's CPU update: params/s of the offload optimizer vs torch.optim.AdamW.

Run: .venv/bin/python bench/offload.py [--params 100e6] [--repeats 7] [--threads N]
Prints a Markdown table and writes bench/results/offload.json.

The offload rows are the real thing: a reference GPT of about --params parameters is
wrapped by a one-rank ZeRO-2 + Offload engine, so the optimizer steps exactly the host
tensors ZeRO-Offload gives it (flat FP32 master segments, their gradient slices, their
Adam states). The torch rows run torch.optim.AdamW (foreach, fused) on an FP32 copy of
the same model's own parameters. Gradients are fixed random values; each variant is
timed for one `optimizer.step()`, median over repeats, variants interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from zerotrain.config import build_config
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT

BYTES_PER_PARAM = 28  # read p, g, m, v + write p, m, v (fp32)


def gpt_config(n_params: float) -> dict:
    """A 768-wide GPT whose depth gets closest to n_params (≈7.1M per block)."""
    per_block = 12 * 768 * 768 + 13 * 768
    return {"n_layer": max(1, round(n_params / per_block)), "n_embd": 768, "n_head": 12,
            "block_size": 256}


def offload_engine(model_cfg: dict, compiled: bool) -> tuple[Engine, callable]:
    cfg = build_config({
        "model": model_cfg, "zero": {"stage": 2, "offload_optimizer": "cpu", "bucket_mb": 64},
        "optimizer": {"lr": 1e-3, "compile": compiled}, "train": {"steps": 100},
        "schedule": {"warmup_steps": 0},
    })
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    s = eng.strategy
    for u in s.units:
        u.grad.normal_()
    s.attach_grads()
    return eng, eng.optimizer.step


def torch_adamw(model_cfg: dict, **kw) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    cfg = build_config({"model": model_cfg})
    model = GPT(cfg.model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=1e-3, **kw)
    return model, opt.step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results/offload.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mcfg = gpt_config(args.params)
    builders = {
        "zerotrain offload AdamW (eager)": lambda: offload_engine(mcfg, False),
        "zerotrain offload AdamW (compiled)": lambda: offload_engine(mcfg, True),
        "torch.optim.AdamW foreach": lambda: torch_adamw(mcfg, foreach=True),
        "torch.optim.AdamW fused": lambda: torch_adamw(mcfg, fused=True),
    }
    times: dict[str, list[float]] = {k: [] for k in builders}
    # Everything lives at once (≈ 5 copies of model state), so variants can interleave.
    live = {name: build() for name, build in builders.items()}
    n_params = sum(p.numel() for p in live["torch.optim.AdamW fused"][0].parameters())
    for _, step in live.values():
        for _ in range(args.warmup):
            step()
    for r in range(args.repeats):
        order = list(live) if r % 2 == 0 else list(reversed(live))
        for name in order:
            t0 = time.perf_counter()
            live[name][1]()
            times[name].append(time.perf_counter() - t0)
    fastest_torch = min(statistics.median(times[k]) for k in times if k.startswith("torch"))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "params": n_params, "median_s": med, "min_s": min(ts),
                     "params_per_s": n_params / med,
                     "gb_per_s": n_params * BYTES_PER_PARAM / med / 1e9,
                     "vs_fastest_torch": fastest_torch / med})
    print(f"\nCPU AdamW update, {n_params / 1e6:.1f}M params, {args.threads} thread(s), "
          f"torch {torch.__version__}\n")
    print("| variant | ms/step | params/s | GB/s (28 B/param) | speed vs fastest torch |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_s'] * 1e3:.1f} | {r['params_per_s'] / 1e6:.0f}M | "
              f"{r['gb_per_s']:.1f} | {r['vs_fastest_torch']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "threads": args.threads, "cores": os.cpu_count(), "machine": platform.machine(),
            "model": mcfg, "repeats": args.repeats}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
