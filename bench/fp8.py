"""FP8 training vs BF16 on the main job's model and data: convergence and CPU cost.

Run: .venv/bin/python bench/fp8.py [--steps 240] [--batch 8] [--threads 2]
                                   [--recipes tensorwise rowwise delayed] [--matmul auto]
Prints a Markdown table and writes bench/results/fp8.json and bench/results/fp8.png.

Every run starts from the same weights and sees the same batches (the main job's
`configs/default.yaml`: 4 × 192 GPT, byte-level stdlib corpus, AdamW, cosine schedule,
clipping), single process, in a plain loop because the engine does not wire FP8 yet.
All runs are BF16 mixed precision as the engine does it: bf16 parameters compute, an
fp32 master copy takes the AdamW update. The FP8 runs additionally swap the blocks'
linears (`Plan.fp8_linears`) for `Fp8Linear`.

The runs advance in lockstep, one step of each in turn (order rotating), so a change in
machine load hits them alike; ms/step is the median step time. Validation: fixed
windows of the validation split, every --eval-every steps and at the end. The default
size (240 steps of 8 windows: the main job's model, data and hyper-parameters, a quarter
of its batch and 57% of its steps) takes about 3.5 minutes on 2 idle cores;
`--steps 300 --batch 16` is closer to the main job and takes about 4× as long.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from zerotrain.config import load_config
from zerotrain.data.corpus import load_tokens, train_val_split
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.models import Group, plan_for
from zerotrain.models.gpt import GPT
from zerotrain.numerics.fp8 import TENSOR_CLASSES, FP8Recipe
from zerotrain.numerics.fp8_linear import Fp8Linear, convert_to_fp8
from zerotrain.optim import AdamW, lr_at
from zerotrain.optim.schedule import schedule_kwargs

ROOT = Path(__file__).resolve().parent.parent


class Run:
    """One model trained with bf16 compute + fp32 master, optionally FP8 linears."""

    def __init__(self, name: str, recipe: str | None, cfg, init: dict, matmul: str):
        self.name, self.cfg = name, cfg
        model = GPT(cfg.model)
        model.load_state_dict(init)
        self.model = model.to(torch.bfloat16)
        self.stats = None
        if recipe is not None:
            rec = FP8Recipe(recipe, cfg.precision.fp8.amax_history, matmul=matmul)
            self.stats = convert_to_fp8(model, plan_for(model), rec)
        plan = plan_for(model)
        self.params = [p for _, p in model.named_parameters()]
        self.master = [p.detach().float().clone() for p in self.params]
        o = cfg.optimizer
        decay = [m for (n, _), m in zip(model.named_parameters(), self.master)
                 if plan.group_of(n) != Group.VECTOR]
        no_decay = [m for (n, _), m in zip(model.named_parameters(), self.master)
                    if plan.group_of(n) == Group.VECTOR]
        self.opt = AdamW([{"params": decay, "weight_decay": o.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}],
                         lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        self.losses: list[float] = []
        self.val: list[tuple[int, float]] = []
        self.times: list[float] = []
        self.totals = {c: {"overflow": 0, "underflow": 0} for c in TENSOR_CLASSES}

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor, total: int) -> None:
        t0 = time.perf_counter()
        loss = self.model(x, y)
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
            p.grad = None
        clip = self.cfg.optimizer.grad_clip
        if clip:
            torch.nn.utils.clip_grad_norm_(self.master, clip)
        lr = lr_at(step, peak_lr=self.cfg.optimizer.lr, total_steps=total,
                   **schedule_kwargs(self.cfg.schedule))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        if self.stats is not None:
            for c, v in self.stats.end_step().items():
                for k in v:
                    self.totals[c][k] += v[k]
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())

    @torch.no_grad()
    def evaluate(self, step: int, batches: list) -> float:
        self.model.eval()
        val = statistics.fmean(self.model(x, y).item() for x, y in batches)
        self.model.train()
        if self.stats is not None:
            self.stats.reset()  # evaluation is not a training step: forget its counts/amaxes
        self.val.append((step, val))
        return val


def layer_costs(tokens: int, d: int, threads: int) -> list[dict]:
    """Forward+backward of one d → 4d linear on `tokens` rows: where the CPU time goes."""
    torch.set_num_threads(threads)
    x = torch.randn(tokens, d, dtype=torch.bfloat16)
    rows = []
    variants = [("nn.Linear fp32", None, None, torch.float32),
                ("nn.Linear bf16", None, None, torch.bfloat16)]
    for rec in ("tensorwise", "rowwise", "delayed"):
        for mm in ("emulate", "scaled_mm"):
            variants.append((f"Fp8Linear {rec} {mm}", rec, mm, torch.bfloat16))
    for name, rec, mm, dtype in variants:
        torch.manual_seed(0)
        lin = torch.nn.Linear(d, 4 * d).to(dtype)
        if rec is not None:
            lin = Fp8Linear.from_linear(lin, FP8Recipe(rec, matmul=mm))
        xi = x.to(dtype).requires_grad_()
        times = []
        for i in range(6):
            t0 = time.perf_counter()
            lin(xi).float().square().mean().backward()
            if i:
                times.append(time.perf_counter() - t0)
        rows.append({"layer": name, "ms": 1e3 * statistics.median(times)})
    return rows


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--warmup", type=int, default=None, help="default: the config's, "
                    "scaled to --steps")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=4, help="of 16 windows each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "delayed"])
    ap.add_argument("--matmul", default="auto", choices=["auto", "scaled_mm", "emulate"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8.json"))
    return ap.parse_args()


def setup(args: argparse.Namespace):
    cfg = load_config(args.config)
    warm = args.warmup
    if warm is None:  # keep the main job's warmup fraction
        warm = round(cfg.schedule.warmup_steps * args.steps / cfg.train.steps)
    cfg = load_config(args.config, {"train": {"steps": args.steps},
                                    "schedule": {"warmup_steps": warm}})
    tokens = load_tokens(cfg.data.path)
    train, val = train_val_split(tokens, cfg.data.val_fraction)
    T = cfg.model.block_size
    sampler = WindowSampler(train, T, cfg.train.seed)
    evals = eval_batches(val, T, 0, 1, 16, args.eval_batches)  # 16 windows per batch
    torch.manual_seed(cfg.train.seed)
    init = GPT(cfg.model).state_dict()
    runs = [Run("bf16", None, cfg, init, args.matmul)]
    runs += [Run(f"fp8-{r}", r, cfg, init, args.matmul) for r in args.recipes]
    return cfg, sampler, evals, runs


def train(args, cfg, sampler, evals, runs) -> float:
    t_start = time.perf_counter()
    for step in range(args.steps):
        x, y = sampler.batch(step, 0, 0, 1, args.batch, 1)
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step, x, y, args.steps)
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            vals = [f"{r.name} {r.evaluate(step + 1, evals):.4f}" for r in runs]
            print(f"step {step + 1:4d}  val: " + "  ".join(vals), flush=True)
    return time.perf_counter() - t_start


def report(args, cfg, runs, wall: float, layers: list[dict]) -> dict:
    base = runs[0]
    bf16_val, bf16_ms = base.val[-1][1], 1e3 * statistics.median(base.times)
    rows = []
    for r in runs:
        ms = 1e3 * statistics.median(r.times)
        rows.append({"run": r.name, "final_val_loss": r.val[-1][1],
                     "ratio_to_bf16": r.val[-1][1] / bf16_val, "ms_per_step": ms,
                     "cost_vs_bf16": ms / bf16_ms, "counts": r.totals,
                     "curve_val": r.val, "curve_train": r.losses})
    print(f"\n{args.steps} steps × {args.batch} × {cfg.model.block_size} tokens, "
          f"{args.threads} threads, {wall:.0f} s in all\n")
    print("| run | final val loss | / bf16 | ms/step | × bf16 | overflow in/w/g | "
          "underflow in/w/g |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["counts"]
        ov = "/".join(str(c[k]["overflow"]) for k in TENSOR_CLASSES)
        un = "/".join(str(c[k]["underflow"]) for k in TENSOR_CLASSES)
        print(f"| {row['run']} | {row['final_val_loss']:.4f} | {row['ratio_to_bf16']:.4f} | "
              f"{row['ms_per_step']:.0f} | {row['cost_vs_bf16']:.2f} | {ov} | {un} |")
    print("\n| one linear, fwd+bwd (4096 × 192 → 768, bf16 in) | ms |\n|---|---|")
    for row in layers:
        print(f"| {row['layer']} | {row['ms']:.1f} |")
    return {"meta": {"steps": args.steps, "batch": args.batch, "threads": args.threads,
                     "matmul": args.matmul, "torch": torch.__version__,
                     "machine": platform.machine(), "wall_s": wall,
                     "model": cfg.model.model_dump(), "schedule": cfg.schedule.model_dump(),
                     "optimizer": cfg.optimizer.model_dump()},
            "rows": rows, "layers": layers}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["rows"]:
        tr = row["curve_train"]
        k = 10  # running mean over k steps
        smooth = [statistics.fmean(tr[max(0, i - k + 1):i + 1]) for i in range(len(tr))]
        ax1.plot(range(1, len(tr) + 1), smooth, label=row["run"], lw=1)
        steps, vals = zip(*row["curve_val"])
        ax2.plot(steps, vals, marker="o", ms=3, label=row["run"], lw=1)
    ax1.set(title="train loss (10-step mean)", xlabel="step", ylabel="nats/byte")
    ax2.set(title="validation loss", xlabel="step", ylabel="nats/byte")
    ax1.set_ylim(top=min(ax1.get_ylim()[1], math.log(256) + 0.2))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    cfg, sampler, evals, runs = setup(args)
    wall = train(args, cfg, sampler, evals, runs)
    layers = layer_costs(4096, cfg.model.n_embd, args.threads)
    result = report(args, cfg, runs, wall, layers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
