"""Compact model states on the main job: fp32 vs bf16 vs int8 optimizer states, and int8
states with bf16 masters (Kahan, stochastic) — loss, bytes per parameter, step time.

Run: .venv/bin/python bench/states.py [--steps 420] [--batch 16] [--threads 2]
                                      [--variants ...] [--peers]
Prints a Markdown table and writes bench/results/states.json.

Every run starts from the same weights and sees the same batches (the main job's
`configs/default.yaml`: 4 × 192 GPT, byte-level stdlib corpus, AdamW, cosine schedule,
clipping), through the zerotrain engine in one process (ZeRO-2's numbers equal one
process's: tests/test_zero.py, tests/test_compact_states.py). The runs advance in
lockstep, one step each in turn (order rotating), so machine load hits them alike.

- final val loss: fixed windows of the validation split, at the end;
- bytes/param: model-state bytes the engine's audit measures (master + optimizer state,
  what compact states change) per parameter, beside the formula: per parameter tensor,
  n·b for fp32/bf16 states, n + 4·ceil(n/256) per int8 state (its block scales); plus
  the master (4 for an fp32 copy, 2 for Kahan's compensation, 0 otherwise);
- opt ms: median wall time of the optimizer step alone (`Strategy.optimizer_step`).

`--peers`: torchao's AdamW8bit and bitsandbytes' AdamW8bit on the same model and data (a
plain fp32 loop with the same schedule and clipping), where their CPU paths run.
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

from zerotrain.config import load_config
from zerotrain.data.corpus import load_tokens, train_val_split
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.engine import Engine
from zerotrain.models import Group, plan_for
from zerotrain.models.gpt import GPT
from zerotrain.optim.schedule import lr_from_config

ROOT = Path(__file__).resolve().parent.parent
BF16_MASTERS = {"dtype": "bf16", "master_dtype": "bf16"}
VARIANTS: dict[str, dict] = {
    "fp32 states": {},
    "bf16 states": {"optimizer": {"state_dtype": "bf16"}},
    "int8 states": {"optimizer": {"state_dtype": "int8"}},
    "bf16 compute, fp32 master (ref)": {"precision": {"dtype": "bf16"}},
    "int8 + bf16 Kahan masters": {
        "optimizer": {"state_dtype": "int8"},
        "precision": {**BF16_MASTERS, "master_update": "kahan"},
    },
    "int8 + bf16 stochastic masters": {
        "optimizer": {"state_dtype": "int8"},
        "precision": {**BF16_MASTERS, "master_update": "stochastic"},
    },
}


class Zt:
    """One variant trained by the engine."""

    def __init__(self, name: str, cfg: Any, init: dict):
        self.name = name
        model = GPT(cfg.model)
        model.load_state_dict(init)
        self.eng = Engine(model, cfg, torch.device("cpu"))
        self.opt_times: list[float] = []
        inner = self.eng.strategy.optimizer_step

        def timed(opt: Any) -> None:
            t0 = time.perf_counter()
            inner(opt)
            self.opt_times.append(time.perf_counter() - t0)

        self.eng.strategy.optimizer_step = timed

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self.eng.backward(self.eng(x, y))
        self.eng.step()

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        self.eng.eval()
        val = statistics.fmean(float(self.eng(x, y)) for x, y in batches)
        self.eng.train()
        return val

    def state_bytes(self) -> tuple[float, float, int]:
        """(measured, formula) master + optimizer bytes, and the parameter count."""
        eng = self.eng
        mem = eng.strategy.memory_breakdown(eng.optimizer.state.values())
        measured = sum(mem[p][c] for p in ("device", "host") for c in ("master", "optimizer"))
        n = sum(p.numel() for p in eng.module.parameters())
        pol = eng.policy
        per_state = {"fp32": 4, "bf16": 2}.get(pol.stored_state_dtype)
        formula = 0
        for _, view in eng.strategy.opt_segments:
            k = view.numel()
            formula += 2 * (k * per_state if per_state else k + 4 * -(-k // 256))
            formula += 2 * k if pol.master_update == "kahan" else 0
        master = sum(
            u.master.numel() * u.master.element_size()
            for u in eng.strategy.units
            if u.master.data_ptr() != u.params.data_ptr()
        )
        return measured, formula + master, n


class Peer:
    """A peer's 8-bit AdamW on the fp32 model, in a plain loop (same lr, decay, clip)."""

    def __init__(self, name: str, cls: Any, cfg: Any, init: dict):
        self.name, self.cfg = name, cfg
        self.model = GPT(cfg.model)
        self.model.load_state_dict(init)
        plan = plan_for(self.model)
        named = list(self.model.named_parameters())
        o = cfg.optimizer
        groups = [
            {
                "params": [p for n, p in named if plan.group_of(n) != Group.VECTOR],
                "weight_decay": o.weight_decay,
            },
            {
                "params": [p for n, p in named if plan.group_of(n) == Group.VECTOR],
                "weight_decay": 0.0,
            },
        ]
        self.opt = cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        self.opt_times: list[float] = []

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        c = self.cfg
        self.model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.optimizer.grad_clip)
        lr = lr_from_config(step, c.schedule, c.optimizer.lr, c.train.steps)
        for g in self.opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        t0 = time.perf_counter()
        self.opt.step()
        self.opt_times.append(time.perf_counter() - t0)
        self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        self.model.eval()
        val = statistics.fmean(float(self.model(x, y)) for x, y in batches)
        self.model.train()
        return val

    def state_bytes(self) -> tuple[float, None, int]:
        def nbytes(t: Any) -> int:
            inner = getattr(t, "__tensor_flatten__", None)
            if inner is not None and type(t) is not torch.Tensor:  # torchao's subclass
                return sum(nbytes(getattr(t, a)) for a in inner()[0])
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        total = sum(
            nbytes(v)
            for st in self.opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return total, None, sum(p.numel() for p in self.model.parameters())


def peers(cfg: Any, init: dict) -> tuple[list[Peer], list[str]]:
    out, notes = [], []
    for name, load in (
        (
            "torchao AdamW8bit",
            lambda: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit,
        ),
        (
            "bitsandbytes AdamW8bit",
            lambda: __import__("bitsandbytes.optim", fromlist=["AdamW8bit"]).AdamW8bit,
        ),
    ):
        try:
            peer = Peer(name, load(), cfg, init)
            probe = GPT(cfg.model)  # one step on a copy: does the CPU path run?
            probe.load_state_dict(init)
            o = load()(probe.parameters(), lr=1e-4)
            for p in probe.parameters():
                p.grad = torch.zeros_like(p)
            o.step()
            out.append(peer)
        except Exception as e:  # not installed, or no CPU kernel: say so
            notes.append(f"{name}: not run ({type(e).__name__}: {str(e)[:120]})")
    return out, notes


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--eval-batches", type=int, default=8, help="of 16 windows each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--peers", action="store_true")
    ap.add_argument(
        "--opt-only",
        action="store_true",
        help="time the optimizer step alone on the main job's parameters (no training): quick",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "states.json"))
    return ap.parse_args()


def opt_only(args: argparse.Namespace) -> None:
    """Median optimizer-step time of each variant on the main job's parameter shapes
    (gradients set once), the variants interleaved so that machine load hits them alike."""
    from zerotrain.numerics.compact import Compact
    from zerotrain.optim import AdamW

    cfg = load_config(args.config)
    torch.manual_seed(0)
    shapes = [p.shape for p in GPT(cfg.model).parameters()]
    specs = {
        "fp32 states": (Compact(), torch.float32),
        "bf16 states": (Compact("bf16"), torch.float32),
        "int8 states": (Compact("int8"), torch.float32),
        "int8 + bf16 Kahan masters": (Compact("int8", "kahan"), torch.bfloat16),
        "int8 + bf16 stochastic masters": (Compact("int8", "stochastic"), torch.bfloat16),
    }
    opts = {}
    for name, (spec, dtype) in specs.items():
        ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape).to(dtype)
        opts[name] = AdamW(ps, lr=1e-3)
        opts[name].compact = spec
    times: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(args.steps):
        order = list(opts)[i % len(opts) :] + list(opts)[: i % len(opts)]
        for k in order:
            t0 = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - t0)
    ref = statistics.median(times["fp32 states"][2:])
    n = sum(math.prod(s) for s in shapes)
    print(f"optimizer step alone, {n:,} parameters, {args.steps} steps, {args.threads} threads")
    print("| run | opt step ms | × fp32 states |\n|---|---|---|")
    for k, ts in times.items():
        ms = statistics.median(ts[2:])
        print(f"| {k} | {1e3 * ms:.1f} | {ms / ref:.2f} |")


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.opt_only:
        opt_only(args)
        return
    base = load_config(args.config)
    warm = round(base.schedule.warmup_steps * args.steps / base.train.steps)
    common = {
        "train": {"steps": args.steps, "device": "cpu"},
        "zero": {"stage": 0},
        "data": {"micro_batch_size": args.batch},
        "schedule": {"warmup_steps": warm},
        "optimizer": {"compile": False},
    }
    cfg = load_config(args.config, common)
    tokens = load_tokens(cfg.data.path)
    train, val = train_val_split(tokens, cfg.data.val_fraction)
    T = cfg.model.block_size
    sampler = WindowSampler(train, T, cfg.train.seed)
    evals = eval_batches(val, T, 0, 1, 16, args.eval_batches)
    torch.manual_seed(cfg.train.seed)
    init = GPT(cfg.model).state_dict()
    runs: list[Any] = []
    for name in args.variants:
        over = {**common, **{k: {**common.get(k, {}), **v} for k, v in VARIANTS[name].items()}}
        runs.append(Zt(name, load_config(args.config, over), init))
    notes: list[str] = []
    if args.peers:
        more, notes = peers(cfg, init)
        runs += more
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = sampler.batch(step, 0, 0, 1, args.batch, 1)
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step, x, y)
        if (step + 1) % 60 == 0:  # progress, and a loss curve that survives a cut-short run
            losses = "  ".join(f"{r.name}: {r.evaluate(evals):.4f}" for r in runs)
            print(f"step {step + 1}  {time.perf_counter() - t0:.0f} s  val {losses}", flush=True)
    report(args, runs, evals, notes, time.perf_counter() - t0)


def report(
    args: argparse.Namespace, runs: list, evals: list, notes: list[str], wall: float
) -> None:
    rows = []
    for r in runs:
        measured, formula, n = r.state_bytes()
        rows.append(
            {
                "run": r.name,
                "final_val_loss": r.evaluate(evals),
                "bytes_per_param": measured / n,
                "formula_per_param": None if formula is None else formula / n,
                "opt_ms": 1e3 * statistics.median(r.opt_times[5:] or r.opt_times),
            }
        )
    ref = rows[0]
    print(
        f"\n{args.steps} steps × {args.batch} × 128 tokens, {args.threads} threads, "
        f"{wall:.0f} s in all\n"
    )
    print(
        "| run | final val loss | vs fp32 states | master+optimizer B/param (measured) "
        "| formula | opt step ms | × fp32 states |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        f = row["formula_per_param"]
        print(
            f"| {row['run']} | {row['final_val_loss']:.4f} | "
            f"{100 * (row['final_val_loss'] / ref['final_val_loss'] - 1):+.2f}% | "
            f"{row['bytes_per_param']:.4f} | {'-' if f is None else f'{f:.4f}'} | "
            f"{row['opt_ms']:.1f} | {row['opt_ms'] / ref['opt_ms']:.2f} |"
        )
    for n in notes:
        print(f"- {n}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "steps": args.steps,
                "batch": args.batch,
                "rows": rows,
                "notes": notes,
                "wall_s": wall,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
