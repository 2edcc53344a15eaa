"""Optimizer step time of compact states against fp32 states, alone (no model, no data).

Run: .venv/bin/python bench/states_step.py [--numel 10000000] [--shapes flat|main]
                                           [--steps 12] [--threads 2] [--modes eager compiled]
Prints a Markdown table and writes bench/results/states_step.json.

Each variant holds its own parameters (one flat tensor of `--numel` elements, or the
main job's parameter shapes with `--shapes main`) with fixed gradients and steps them;
the variants take turns step by step (the order rotating), so that load from other
processes hits them alike; each time is the median over the steps after two warm ones,
and the best of them (the least disturbed by other processes on a shared machine).
Ratios are against fp32 states *in the same mode*: eager against eager, compiled
(`optimizer.compile: true`: for AdamW the fp32 rule itself is fused; for compact states
also the (de)quantisation and rounding) against compiled. The compiled kernels are built
in a warm-up before timing (seconds to minutes on a busy machine; torch caches them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zerotrain.numerics.compact import Compact
from zerotrain.optim import AdamW, Lion

ROOT = Path(__file__).resolve().parent.parent
SPECS: dict[str, tuple[Compact, torch.dtype]] = {
    "fp32 states": (Compact(), torch.float32),
    "bf16 states": (Compact("bf16"), torch.float32),
    "int8 states": (Compact("int8"), torch.float32),
    "int8 + bf16 Kahan masters": (Compact("int8", "kahan"), torch.bfloat16),
    "int8 + bf16 stochastic masters": (Compact("int8", "stochastic"), torch.bfloat16),
}


def shapes(args: argparse.Namespace) -> list[tuple[int, ...]]:
    if args.shapes == "flat":
        return [(args.numel,)]
    from zerotrain.config import load_config
    from zerotrain.models.gpt import GPT

    cfg = load_config(str(ROOT / "configs" / "default.yaml"))
    return [tuple(p.shape) for p in GPT(cfg.model).parameters()]


def make(opt: str, spec: Compact, dtype: torch.dtype, shp: list, compiled: bool) -> Any:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shp]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    if opt == "adamw":
        o: Any = AdamW(ps, lr=1e-3, weight_decay=0.1, compiled=compiled)
    else:
        o = Lion(ps, lr=1e-4, weight_decay=0.1)
    o.compact = spec
    o.compact_compiled = compiled and spec.active
    return o


def measure(args: argparse.Namespace) -> list[dict]:
    shp = shapes(args)
    rows = []
    for opt in args.optimizers:
        for mode in args.modes:
            opts = {k: make(opt, s, d, shp, mode == "compiled") for k, (s, d) in SPECS.items()}
            for o in opts.values():  # warm-up: states made, kernels compiled
                o.step()
                o.step()
            times: dict[str, list[float]] = {k: [] for k in opts}
            names = list(opts)
            for i in range(args.steps):
                for k in names[i % len(names) :] + names[: i % len(names)]:
                    t0 = time.perf_counter()
                    opts[k].step()
                    times[k].append(time.perf_counter() - t0)
            ref = statistics.median(times["fp32 states"])
            for k, ts in times.items():
                ms = statistics.median(ts)
                rows.append(
                    {
                        "optimizer": opt,
                        "mode": mode,
                        "run": k,
                        "ms": 1e3 * ms,
                        "x_fp32": ms / ref,
                        "min_ms": 1e3 * min(ts),
                        "x_fp32_best": min(ts) / min(times["fp32 states"]),
                    }
                )
            del opts
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--shapes", choices=["flat", "main"], default="flat")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "lion"], choices=["adamw", "lion"])
    ap.add_argument(
        "--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"]
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "states_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args)
    n = sum(math.prod(s) for s in shapes(args))
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(
        f"optimizer step alone, {n:,} parameters ({args.shapes}), {args.steps} steps, "
        f"{args.threads} threads, load average {load} at the end\n"
    )
    print("| optimizer | mode | run | ms median | × fp32 | ms best | × fp32 (best) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['optimizer']} | {r['mode']} | {r['run']} | {r['ms']:.1f} | {r['x_fp32']:.2f} "
            f"| {r['min_ms']:.1f} | {r['x_fp32_best']:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "numel": n,
                "shapes": args.shapes,
                "steps": args.steps,
                "threads": args.threads,
                "loadavg_end": load,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
