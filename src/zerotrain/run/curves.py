"""curves.png: the losses, the train–validation gap, and the lr of every step.

`curve_series` computes everything the figure shows and `plot_curves` only draws it, so
tests check the data rather than the picture. The lr line comes from the schedule
itself, evaluated at every step of the run: logged points (every `log_every` steps)
would cut off the warmup's peak in a short run. The logged lrs are drawn over it as
dots, so a resumed run whose schedule changed shows what was actually used.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotrain.run.fit import pair_evaluations

Series = dict[str, tuple[list[float], list[float]]]


def curve_series(records: list[dict[str, Any]], lr_at: Callable[[int], float] | None,
                 total_steps: int) -> Series:
    """name -> (x, y) in optimizer steps: train, val, gap (validation − training loss,
    paired as `fit.pair_evaluations` does), lr_logged and lr_schedule.

    A train record at step x carries the lr of update x, which is lr_at(x − 1) (lr_at
    takes the number of updates already done), so lr_schedule is drawn the same way.
    """
    tr = [r for r in records if r.get("type") == "train"]
    va = [r for r in records if r.get("type") == "val"]
    steps, train_mean, val = pair_evaluations(records)
    out: Series = {
        "train": ([r["step"] for r in tr], [r["loss"] for r in tr]),
        "val": ([r["step"] for r in va], [r["val_loss"] for r in va]),
        "gap": (list(steps), [v - t for t, v in zip(train_mean, val)]),
        "lr_logged": ([r["step"] for r in tr], [r["lr"] for r in tr]),
        "lr_schedule": ([], []),
    }
    if lr_at is not None:
        xs = list(range(1, total_steps + 1))
        out["lr_schedule"] = (xs, [lr_at(x - 1) for x in xs])
    return out


def plot_curves(series: Series, path: Path, baseline: float, baseline_label: str) -> None:
    """Three panels sharing the step axis: losses, gap, learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True,
                                     gridspec_kw={"height_ratios": [3, 1.4, 1.4]})
    a1.plot(*series["train"], label="train")
    a1.plot(*series["val"], "o-", label="validation")
    a1.axhline(baseline, ls=":", c="gray", label=baseline_label)
    a1.set_ylabel("loss (nats/token)")
    a1.legend()
    a2.axhline(0.0, c="gray", lw=0.8)
    a2.plot(*series["gap"], "o-", c="C3")
    a2.set_ylabel("gap: val − train", fontsize=9)
    if series["lr_schedule"][0]:
        a3.plot(*series["lr_schedule"], c="C2", label="schedule")
    a3.plot(*series["lr_logged"], ".", c="C2", ms=3, alpha=0.6, label="logged")
    a3.set_ylabel("learning rate")
    a3.set_xlabel("optimizer step")
    a3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
