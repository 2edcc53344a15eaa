"""Learning-rate schedule: warmup → hold → decay → floor, as a pure function of the step.

`lr_at(step, ...)` takes `step` = the number of optimizer steps already completed and
returns the lr for update number step+1. Being a pure function of one integer is what
makes resume exact: a checkpoint only needs the step.

Phases (W = warmup_steps, H = hold_steps, S = decay_start, default W+H,
D = decay_steps, default total − S):
- warmup  0 ≤ s < W:        from warmup_start_lr (at s = 0) to peak_lr (at s = W), linear in
                            s, or with warmup_type "log" along log(s+1)/log(W) (DeepSpeed's
                            default curve, which reaches the peak one step early, at W−1)
- hold    W ≤ s < S:        peak_lr
- decay   S ≤ s ≤ S+D:      cosine (default) or linear from peak_lr to min_lr;
                            "constant" never decays (peak forever after warmup). A decay_start
                            of W−1 starts the cosine one step before the warmup ends, so its
                            first post-warmup value is already one step in (DeepSpeed's
                            WarmupCosineLR); the warmup still governs every s < W
- after:  min_lr
- "wsd" (warmup–stable–decay, Hu et al. 2024): warmup, then stable at peak, then a
  decay over the final `wsd_decay_fraction` of the post-warmup steps (or decay_steps
  when given) with the 1−√x shape, which Hägele et al. 2024 found to beat linear
  cooldowns; it ends at min_lr exactly at total_steps.

With the default warmup_start_lr 0 the very first update has lr 0: the optimizer
state (Adam's moments) starts accumulating while the weights stay put.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    from zerotrain.config import ScheduleConfig

KINDS = ("cosine", "linear", "constant", "wsd")
WARMUP_TYPES = ("linear", "log")


def _validate(step: int, peak_lr: float, total_steps: int, kind: str, warmup_steps: int,
              warmup_start_lr: float, hold_steps: int, min_lr: float,
              decay_steps: int | None, wsd_decay_fraction: float, warmup_type: str,
              decay_start: int | None) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    need(kind in KINDS, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    need(step >= 0, f"step must be >= 0, got {step}")
    need(total_steps >= 1, f"total_steps must be >= 1, got {total_steps}")
    need(peak_lr > 0, f"peak_lr must be > 0, got {peak_lr}")
    need(0 <= min_lr <= peak_lr, f"min_lr ({min_lr}) must lie in [0, peak_lr ({peak_lr})]")
    need(0 <= warmup_start_lr <= peak_lr,
         f"warmup_start_lr ({warmup_start_lr}) must lie in [0, peak_lr ({peak_lr})]")
    need(warmup_steps >= 0 and hold_steps >= 0,
         f"warmup_steps ({warmup_steps}) and hold_steps ({hold_steps}) must be >= 0")
    need(warmup_steps + hold_steps <= total_steps,
         f"warmup_steps + hold_steps ({warmup_steps + hold_steps}) exceed total_steps "
         f"({total_steps}); shorten warmup_steps/hold_steps or raise total_steps")
    need(decay_steps is None or decay_steps >= 1, f"decay_steps must be >= 1, got {decay_steps}")
    need(0 < wsd_decay_fraction <= 1,
         f"wsd_decay_fraction must lie in (0, 1], got {wsd_decay_fraction}")
    need(kind != "wsd" or hold_steps == 0,
         "hold_steps must be 0 for kind 'wsd': its stable phase already lasts until the "
         "final wsd_decay_fraction of the steps")
    need(warmup_type in WARMUP_TYPES,
         f"warmup_type must be one of {', '.join(WARMUP_TYPES)}, got {warmup_type!r}")
    need(warmup_type != "log" or warmup_steps != 1,
         "warmup_type 'log' needs warmup_steps 0 or >= 2 (it divides by log(warmup_steps))")
    need(decay_start is None or (decay_start >= 0 and kind in ("cosine", "linear")
                                 and hold_steps == 0),
         f"decay_start ({decay_start}) must be >= 0, with kind cosine or linear and "
         "hold_steps 0 (it replaces warmup_steps + hold_steps)")


def phases(*, total_steps: int, kind: str = "cosine", warmup_steps: int = 0,
           hold_steps: int = 0, decay_steps: int | None = None,
           wsd_decay_fraction: float = 0.2,
           decay_start: int | None = None) -> tuple[int, int, int]:
    """(end of warmup, start of decay, end of decay) as step numbers."""
    if kind == "wsd":
        d = decay_steps or max(1, round(wsd_decay_fraction * (total_steps - warmup_steps)))
        start = max(warmup_steps, total_steps - d)
        return warmup_steps, start, start + d
    start = warmup_steps + hold_steps if decay_start is None else decay_start
    d = decay_steps if decay_steps is not None else total_steps - start
    return warmup_steps, start, start + d


def lr_at(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    kind: str = "cosine",
    warmup_steps: int = 0,
    warmup_start_lr: float = 0.0,
    hold_steps: int = 0,
    min_lr: float = 0.0,
    decay_steps: int | None = None,
    wsd_decay_fraction: float = 0.2,
    warmup_type: str = "linear",
    decay_start: int | None = None,
) -> float:
    """The lr for update step+1, `step` being the number of updates already done."""
    _validate(step, peak_lr, total_steps, kind, warmup_steps, warmup_start_lr, hold_steps,
              min_lr, decay_steps, wsd_decay_fraction, warmup_type, decay_start)
    w_end, d_start, d_end = phases(total_steps=total_steps, kind=kind,
                                   warmup_steps=warmup_steps, hold_steps=hold_steps,
                                   decay_steps=decay_steps,
                                   wsd_decay_fraction=wsd_decay_fraction,
                                   decay_start=decay_start)
    if step < w_end:
        if warmup_type == "log":  # 0 at s = 0, 1 at s = W−1
            frac = 1.0 / math.log(w_end) * math.log(step + 1)
        else:
            frac = step / w_end
        return warmup_start_lr + (peak_lr - warmup_start_lr) * frac
    if kind == "constant" or step < d_start:
        return peak_lr
    if step >= d_end:
        return min_lr
    x = (step - d_start) / (d_end - d_start)  # decay progress in [0, 1)
    if kind == "cosine":
        frac = 0.5 * (1 + math.cos(math.pi * x))
    elif kind == "linear":
        frac = 1 - x
    else:  # wsd
        frac = 1 - math.sqrt(x)
    return min_lr + (peak_lr - min_lr) * frac


def schedule_kwargs(cfg: ScheduleConfig) -> dict[str, Any]:
    """The lr_at keyword arguments a ScheduleConfig carries (all but peak and total)."""
    return dict(kind=cfg.kind, warmup_steps=cfg.warmup_steps,
                warmup_start_lr=cfg.warmup_start_lr, hold_steps=cfg.hold_steps,
                min_lr=cfg.min_lr, decay_steps=cfg.decay_steps,
                wsd_decay_fraction=cfg.wsd_decay_fraction, warmup_type=cfg.warmup_type,
                decay_start=cfg.decay_start)


def describe(peak_lr: float, total_steps: int, **kw: Any) -> str:
    """The schedule in one line, for a run to print at start (kw: lr_at's keywords)."""
    lr_at(0, peak_lr=peak_lr, total_steps=total_steps, **kw)  # validate
    kind, w = kw.get("kind", "cosine"), kw.get("warmup_steps", 0)
    w_end, d_start, d_end = phases(total_steps=total_steps, **{
        k: v for k, v in kw.items() if k in ("kind", "warmup_steps", "hold_steps",
                                             "decay_steps", "wsd_decay_fraction",
                                             "decay_start")})
    parts = []
    if w:
        parts.append(f"{kw.get('warmup_type', 'linear')} warmup {kw.get('warmup_start_lr', 0):g}"
                     f" -> {peak_lr:g} over {w} steps")
    if kind == "constant":
        return "lr: " + ", ".join([*parts, f"then constant {peak_lr:g}"] if parts
                                  else [f"constant {peak_lr:g}"])
    if d_start > w_end:
        parts.append(f"hold {peak_lr:g} until step {d_start}")
    parts.append(f"{kind} decay from step {d_start} to {kw.get('min_lr', 0):g} at step {d_end}")
    return "lr: " + ", ".join(parts)


def lr_from_config(step: int, cfg: ScheduleConfig, peak_lr: float, total_steps: int) -> float:
    """lr_at driven by the `schedule:` config section (peak is optimizer.lr)."""
    return lr_at(step, peak_lr=peak_lr, total_steps=total_steps, **schedule_kwargs(cfg))


class WarmupDecayLR(LRScheduler):
    """torch LRScheduler over `lr_at`; its whole state is the step, so resume is exact.

    Each group gets lr_at(...) · base_lr / peak_lr, where base_lr is the group's lr at
    construction and peak_lr defaults to the largest of them: one group sees exactly
    lr_at, several keep their ratios (min_lr and warmup_start_lr scale along).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_steps: int,
                 peak_lr: float | None = None, last_epoch: int = -1, **kwargs: Any) -> None:
        base = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.peak_lr = float(peak_lr if peak_lr is not None else max(base))
        self.total_steps = total_steps
        self.kwargs = kwargs
        lr_at(0, peak_lr=self.peak_lr, total_steps=total_steps, **kwargs)  # validate now
        super().__init__(optimizer, last_epoch)

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                    total_steps: int, peak_lr: float | None = None) -> WarmupDecayLR:
        return cls(optimizer, total_steps=total_steps, peak_lr=peak_lr, **schedule_kwargs(cfg))

    def get_lr(self) -> list[float]:  # type: ignore[override]
        lr = lr_at(self.last_epoch, peak_lr=self.peak_lr, total_steps=self.total_steps,
                   **self.kwargs)
        return [lr * (base / self.peak_lr) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["step"])
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


# ----------------------------------------------------------------------------- CLI

_FLAGS = {"peak_lr": "--peak-lr", "total_steps": "--steps", "warmup_steps": "--warmup",
          "hold_steps": "--hold", "min_lr": "--min-lr", "warmup_start_lr": "--warmup-start-lr",
          "decay_steps": "--decay-steps", "wsd_decay_fraction": "--wsd-fraction",
          "kind": "--kind"}


def key_points(total_steps: int, **kw: Any) -> list[tuple[str, int]]:
    """Named steps worth printing: start, phase boundaries, mid-decay, end."""
    w_end, d_start, d_end = phases(total_steps=total_steps, **{
        k: v for k, v in kw.items() if k in ("kind", "warmup_steps", "hold_steps",
                                             "decay_steps", "wsd_decay_fraction")})
    pts = [("start", 0)]
    if w_end > 0:
        pts.append(("end of warmup", w_end))
    if kw.get("kind") == "constant":
        pts.append(("end", total_steps))
        return pts
    if d_start > w_end:
        pts.append(("decay starts" if kw.get("kind") == "wsd" else "end of hold", d_start))
    if d_end > d_start:
        pts += [("mid-decay", (d_start + d_end) // 2), ("end of decay", d_end)]
    pts.append(("end", total_steps))
    seen: set[int] = set()
    return [(n, s) for n, s in pts if not (s in seen or seen.add(s))]  # type: ignore[func-returns-value]


def _plot(path: str, total_steps: int, kw: dict[str, Any], points: list[tuple[str, int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = min(total_steps, 2000)  # enough points for a smooth curve on long runs
    steps = sorted({round(i * total_steps / n) for i in range(n + 1)} | {s for _, s in points})
    lrs = [lr_at(s, total_steps=total_steps, **kw) for s in steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, lrs, color="C0", lw=2)
    w_end, d_start, d_end = phases(total_steps=total_steps, **{
        k: kw[k] for k in ("kind", "warmup_steps", "hold_steps", "decay_steps",
                           "wsd_decay_fraction")})
    spans = [("warmup", 0, w_end, "C1"), ("hold" if kw["kind"] != "wsd" else "stable",
                                          w_end, d_start, "C2")]
    if kw["kind"] != "constant":
        spans.append(("decay", d_start, min(d_end, total_steps), "C3"))
    for label, a, b, color in spans:
        if b > a:
            ax.axvspan(a, b, color=color, alpha=0.12, label=label)
    for _, s in points:
        if 0 < s < total_steps:
            ax.axvline(s, color="grey", ls=":", lw=1)
    ax.set_xlabel("optimizer steps completed")
    ax.set_ylabel("learning rate")
    ax.set_title(f"{kw['kind']} schedule, peak {kw['peak_lr']:g}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line instead of argparse's usage dump."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main_schedule(argv: list[str]) -> int:
    """`zerotrain schedule`: print (and optionally plot) the lr at the schedule's key points."""
    from zerotrain.config import OptimizerConfig, ScheduleConfig, TrainConfig

    d = {k: f.default for k, f in ScheduleConfig.model_fields.items()}
    parser = _Parser(
        prog="zerotrain schedule",
        description="Show the learning-rate schedule: warmup, hold, decay, floor.")
    parser.add_argument("--peak-lr", type=float, default=OptimizerConfig.model_fields["lr"].default)
    parser.add_argument("--steps", type=int, default=TrainConfig.model_fields["steps"].default,
                        help="total optimizer steps")
    parser.add_argument("--warmup", type=int, default=d["warmup_steps"])
    parser.add_argument("--hold", type=int, default=d["hold_steps"])
    parser.add_argument("--min-lr", type=float, default=d["min_lr"])
    parser.add_argument("--kind", default=d["kind"], choices=KINDS)
    parser.add_argument("--warmup-start-lr", type=float, default=d["warmup_start_lr"])
    parser.add_argument("--decay-steps", type=int, default=d["decay_steps"])
    parser.add_argument("--wsd-fraction", type=float, default=d["wsd_decay_fraction"])
    parser.add_argument("--plot", metavar="PNG", help="also draw the curve to this file")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the message
        return int(e.code or 0)
    kw = dict(peak_lr=args.peak_lr, kind=args.kind, warmup_steps=args.warmup,
              warmup_start_lr=args.warmup_start_lr, hold_steps=args.hold, min_lr=args.min_lr,
              decay_steps=args.decay_steps, wsd_decay_fraction=args.wsd_fraction)
    try:
        lr_at(0, total_steps=args.steps, **kw)
    except ValueError as e:
        msg = re.sub(r"\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m.group(1)], str(e))
        print(f"zerotrain schedule: error: {msg}", file=sys.stderr)
        return 2
    points = key_points(args.steps, **kw)
    print(f"{args.kind} schedule over {args.steps} steps, peak lr {args.peak_lr:g}")
    print(f"{'point':<15} {'step':>8} {'lr':>12}")
    for name, s in points:
        print(f"{name:<15} {s:>8} {lr_at(s, total_steps=args.steps, **kw):>12.4e}")
    if args.plot:
        try:
            _plot(args.plot, args.steps, kw, points)
        except OSError as e:
            print(f"zerotrain schedule: error: cannot write plot '{args.plot}': {e}",
                  file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0
