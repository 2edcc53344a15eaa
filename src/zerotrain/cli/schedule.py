"""`zerotrain schedule`: the learning rate at the schedule's key points, and a plot.

The numbers come from `optim.schedule.lr_at`, the very function training calls; the
defaults are the config's, so what this prints is what `zerotrain train` would do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerotrain.cli.args import (
    Parser,
    UsageError,
    command,
    finite_float,
    plot_path,
    rename_fields,
)
from zerotrain.optim.schedule import KINDS, key_points, lr_at, phases

# lr_at's parameter names -> the flags a user types, for error messages
FLAGS = {"peak_lr": "--peak-lr", "total_steps": "--steps", "warmup_steps": "--warmup",
         "hold_steps": "--hold", "min_lr": "--min-lr", "warmup_start_lr": "--warmup-start-lr",
         "decay_steps": "--decay-steps", "wsd_decay_fraction": "--wsd-fraction",
         "kind": "--kind"}


def _parser() -> Parser:
    from zerotrain.config import OptimizerConfig, ScheduleConfig, TrainConfig

    d = {k: f.default for k, f in ScheduleConfig.model_fields.items()}
    p = Parser("schedule", "Show the learning-rate schedule: linear warmup, hold at the peak, "
               "decay, floor. Defaults are the config's (schedule.*, optimizer.lr, "
               "train.steps). Background: docs/design.md §schedule.")
    p.add_argument("--peak-lr", metavar="LR", type=finite_float,
                   default=OptimizerConfig.model_fields["lr"].default,
                   help="peak learning rate (optimizer.lr)")
    p.add_argument("--steps", metavar="N", type=int,
                   default=TrainConfig.model_fields["steps"].default,
                   help="total optimizer steps (train.steps)")
    p.add_argument("--warmup", metavar="N", type=int, default=d["warmup_steps"],
                   help="steps of linear warmup from --warmup-start-lr to the peak")
    p.add_argument("--hold", metavar="N", type=int, default=d["hold_steps"],
                   help="steps held at the peak after warmup")
    p.add_argument("--min-lr", metavar="LR", type=finite_float, default=d["min_lr"],
                   help="floor the decay ends at")
    p.add_argument("--kind", default=d["kind"], choices=KINDS,
                   help="decay shape; wsd = warmup-stable-decay")
    p.add_argument("--warmup-start-lr", metavar="LR", type=finite_float,
                   default=d["warmup_start_lr"], help="lr of the very first update")
    p.add_argument("--decay-steps", metavar="N", type=int, default=d["decay_steps"],
                   help="length of the decay (default: until --steps)")
    p.add_argument("--wsd-fraction", metavar="F", type=finite_float,
                   default=d["wsd_decay_fraction"],
                   help="wsd: fraction of the post-warmup steps spent decaying")
    p.add_argument("--plot", metavar="FILE", help="also draw the curve (.png, .pdf, .svg, ...)")
    return p


def plot_schedule(path: Path, total_steps: int, kw: dict[str, Any],
                  points: list[tuple[str, int]]) -> None:
    """The lr curve with its phases shaded and the key points marked."""
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


@command("schedule")
def main_schedule(argv: list[str]) -> int:
    """`zerotrain schedule`: print (and optionally plot) the lr at the schedule's key points."""
    args = _parser().parse_args(argv)
    plot = plot_path(args.plot) if args.plot else None
    kw = dict(peak_lr=args.peak_lr, kind=args.kind, warmup_steps=args.warmup,
              warmup_start_lr=args.warmup_start_lr, hold_steps=args.hold, min_lr=args.min_lr,
              decay_steps=args.decay_steps, wsd_decay_fraction=args.wsd_fraction)
    try:
        lr_at(0, total_steps=args.steps, **kw)
    except ValueError as e:
        raise UsageError(rename_fields(str(e), FLAGS)) from None
    points = key_points(args.steps, **kw)
    print(f"{args.kind} schedule over {args.steps} steps, peak lr {args.peak_lr:g}")
    print(f"{'point':<15} {'step':>8} {'lr':>12}")
    for name, s in points:
        print(f"{name:<15} {s:>8} {lr_at(s, total_steps=args.steps, **kw):>12.4e}")
    if plot is not None:
        try:
            plot_schedule(plot, args.steps, kw, points)
        except OSError as e:
            raise UsageError(f"cannot write --plot '{plot}': {e.strerror or e}") from None
        print(f"plot written to {plot}")
    return 0
