"""AdamW step throughput on CPU: zerotrain vs torch.optim.AdamW (foreach and fused).

Run: .venv/bin/python bench/optim.py [--sizes 10e6 100e6] [--repeats N] [--threads N]
Prints a Markdown table and writes bench/results/optim.json.

What is measured: the wall time of one `optimizer.step()` (gradients already set),
median over repeats after warmup steps, variants interleaved in alternating order so
that drift in machine load hits all of them alike. Layouts:
- "mix": a GPT-like set of tensors (12 blocks of attention/MLP matrices, biases, norms,
  an embedding) in two groups (decay / no decay): what a normal user hands over.
- "flat": 4 large 1-D segments in two groups: what the ZeRO engine hands over.
Both layouts are views of the same four flat buffers (p, g, m, v), so the footprint
stays 16 B/param however many variants run (the state of all variants is shared).

Memory traffic counted per parameter: read p, g, m, v (16 B) + write p, m, v (12 B) =
28 B: what a single fused pass must move. A multi-pass implementation moves more,
so its "GB/s" is the useful traffic rate, not what the memory bus saw.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerotrain.optim import AdamW, batching

BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
WD = 0.1


def gpt_shapes(n: int) -> list[tuple[int, ...]]:
    """Tensor shapes of a 12-layer GPT with about n parameters (the embedding absorbs the rest)."""
    d = 256 if n <= 30_000_000 else 768
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
             (d, 4 * d), (d,)]
    shapes = block * 12 + [(d,), (d,)]
    used = sum(torch.Size(s).numel() for s in shapes)
    rows = (n - used) // d
    shapes.append((rows, d))
    rest = n - used - rows * d
    if rest:
        shapes.append((rest,))
    return shapes


def layouts(n: int, flats: dict[str, torch.Tensor]) -> dict[str, Callable[[], list[dict]]]:
    """Fresh param-group lists (new view tensors, same storage) for each layout."""

    def views(shapes):
        out, off = [], 0
        for shape in shapes:
            k = torch.Size(shape).numel()
            v = {name: t[off:off + k].view(shape) for name, t in flats.items()}
            v["p"].grad = v["g"]
            out.append(v)
            off += k
        return out

    def mix():
        vs = views(gpt_shapes(n))
        return [{"params": [v for v in vs if v["p"].ndim >= 2], "weight_decay": WD},
                {"params": [v for v in vs if v["p"].ndim < 2], "weight_decay": 0.0}]

    def flat():
        sizes = [n * 50 // 100, n * 45 // 100, n * 4 // 100]
        sizes.append(n - sum(sizes))
        vs = views([(s,) for s in sizes])
        return [{"params": vs[:2], "weight_decay": WD}, {"params": vs[2:], "weight_decay": 0.0}]

    return {"mix": mix, "flat": flat}


def variants(n: int, flats: dict[str, torch.Tensor]) -> list[dict]:
    """The contenders. All share p, g, m, v storage (state pre-set to views of m and v),
    which keeps the footprint at 16 B/param however many variants run."""
    lay = layouts(n, flats)
    spec = [
        ("torch AdamW foreach", "mix", lambda g: torch.optim.AdamW(g, **HYPER, foreach=True)),
        ("torch AdamW fused", "mix", lambda g: torch.optim.AdamW(g, **HYPER, fused=True)),
        ("torch AdamW fused", "flat", lambda g: torch.optim.AdamW(g, **HYPER, fused=True)),
        ("zerotrain AdamW", "mix", lambda g: AdamW(g, **HYPER)),
        ("zerotrain AdamW", "flat", lambda g: AdamW(g, **HYPER)),
        ("zerotrain AdamW compiled", "mix", lambda g: AdamW(g, **HYPER, compiled=True)),
        ("zerotrain AdamW compiled", "flat", lambda g: AdamW(g, **HYPER, compiled=True)),
    ]
    out = []
    for name, layout, make in spec:
        groups = lay[layout]()
        opt = make([{**g, "params": [v["p"] for v in g["params"]]} for g in groups])
        for g in groups:
            for v in g["params"]:
                opt.state[v["p"]] = {"step": torch.tensor(0.0), "exp_avg": v["m"],
                                     "exp_avg_sq": v["v"]}
        out.append(dict(name=name, layout=layout, opt=opt, times=[],
                        tensors=sum(len(g["params"]) for g in groups)))
    return out


def bench_size(n: int, repeats: int, warmup: int) -> list[dict]:
    flats = dict(p=torch.randn(n) * 0.02, g=torch.randn(n) * 1e-3, m=torch.zeros(n),
                 v=torch.zeros(n))
    vs = variants(n, flats)
    for v in vs:
        v["warmup_s"] = 0.0
    for _ in range(warmup):  # fault pages in, compile, let the VM settle
        for v in vs:
            t0 = time.perf_counter()
            v["opt"].step()
            v["warmup_s"] += time.perf_counter() - t0
    for v in vs:
        if "compiled" in v["name"] and batching.compile_broken():
            v["name"] += " (compile failed: eager)"
    for r in range(repeats):
        for v in vs if r % 2 == 0 else vs[::-1]:
            t0 = time.perf_counter()
            v["opt"].step()
            v["times"].append(time.perf_counter() - t0)
    rows = []
    for v in vs:
        t = statistics.median(v["times"])
        rows.append(dict(variant=v["name"], layout=v["layout"], tensors=v["tensors"], params=n,
                         median_ms=t * 1e3, min_ms=min(v["times"]) * 1e3,
                         params_per_s=n / t, gb_per_s=n * BYTES_PER_PARAM / t / 1e9,
                         warmup_s=v["warmup_s"], repeats=repeats))
    best_torch = min(r["median_ms"] for r in rows if r["variant"].startswith("torch"))
    for r in rows:
        r["speed_vs_best_torch"] = best_torch / r["median_ms"]
    del vs
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    ap.add_argument("--repeats", type=int, default=0, help="default: 15 (≤10M), 5 above")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads "
                    "(default: torch's); 1 gives steadier numbers on a shared machine")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "optim.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for n in (int(s) for s in args.sizes):
        rows += bench_size(n, args.repeats or (15 if n <= 10_000_000 else 5), args.warmup)
    load = (load_before, os.getloadavg()[0])
    print(f"\nAdamW step on CPU ({platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, load average "
          f"{load[0]:.1f} before / {load[1]:.1f} after); GB/s counts {BYTES_PER_PARAM} B/param "
          "(read p,g,m,v + write p,m,v)\n")
    print("| params | variant | layout | tensors | ms/step (median) | Mparams/s | GB/s "
          "| vs fastest torch |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['params'] / 1e6:.0f}M | {r['variant']} | {r['layout']} | {r['tensors']} "
              f"| {r['median_ms']:.1f} | {r['params_per_s'] / 1e6:.0f} | {r['gb_per_s']:.1f} "
              f"| {r['speed_vs_best_torch']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(),
                cores=os.cpu_count(), load_average=load, machine=platform.machine(),
                bytes_per_param=BYTES_PER_PARAM,
                block_elements=batching.BLOCK_ELEMENTS, hyper=dict(HYPER, weight_decay=WD))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
