"""`zerotrain lr-find`: a learning-rate range test on the configured model and data.

The run is built exactly as `zerotrain train` builds it (`setup.setup`: data, model,
ZeRO stage, precision, ranks), then trained for N optimizer steps while the lr grows
exponentially from `start_lr` to `end_lr`; the engine takes each step's lr from
`Engine.lr_override` instead of the schedule. It writes into its own folder,
`<logging.run_dir>/lr-find/` (metrics.jsonl, lr_find.json, lr_find.png), never saves a
checkpoint and never touches the run folder's own files.

The rules (printed by the command and written into lr_find.json):

- **Pairing.** Each point is (lr of update s, training loss measured at step s+1): the
  loss a step reports is computed before its own update, so it shows the effect of the
  lrs before it. The loss is the mean over ranks.
- **Smoothing** (`SMOOTHING`). While the test runs: an exponential moving average of
  the loss with β = 1 − 10/N, which remembers about a tenth of the ramp (β = 0.9 for
  the default 100 steps), so any --steps smooths over the same span of lr; it is divided
  by 1 − β^t so the first values are not pulled toward zero. That average lags the lr
  (by nine steps of 100 over five decades, a factor 2.8 in lr), so once the test is
  over the suggestion and the plot use the same average run forward and then backward
  over the finished curve, which has no lag.
- **Divergence** (`DIVERGENCE`). The test stops when a loss is not finite, or the
  running smoothed loss exceeds 2× its lowest value so far: the lr is then far beyond
  anything a run could use, and further steps only cost time. A language model's loss
  spans a narrow range (ln V at the start, seldom below a third of that), so doubling
  means the updates are destroying what was learnt; the 4× common in range tests for
  losses that fall by orders of magnitude would fire only once the loss has exploded.
- **Suggestion** (`SUGGESTION`). The smallest lr at which the lag-free smoothed loss has
  made 95% of its fall from its first value to its lowest: the start of the valley.
  Below it larger steps still buy clear progress, past it almost none, and further on
  the loss diverges; a run's peak is the largest lr that still clearly pays, with the
  warmup and decay around it keeping it off the edge. Not the minimum (or a fraction of
  it): a language model's valley is often flat over a decade or more, so noise decides
  where its lowest point lies (over four seeds on the tests' tiny models, 100 steps:
  the valley's start moved at most 2×, its lowest point up to 6×, a tenth of the
  running average's minimum up to 12×). Not the steepest descent: the derivative of a
  noisy curve, it moved 14× between a 60-step and a 100-step test of the main job's
  config, where the valley's start gave 2.9e-3 and 2.1e-3 (optimizer.lr is 3e-3; in
  that job's 420 steps, 3e-3 reached validation loss 1.82 and 1e-3 1.98).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotrain.config import Config, ConfigError, build_config

MEMORY = 0.1  # the running average remembers this fraction of the ramp
DIVERGE_FACTOR = 2.0
FALL_DONE = 0.95
MIN_STEPS = 10
SMOOTHING = ("exponential moving average of the loss remembering a tenth of the ramp (beta = "
             "1 - 10/steps), bias-corrected (divided by 1 - beta^t); after the test, run "
             "forward then backward (no lag)")
DIVERGENCE = (f"a non-finite loss, or the running smoothed loss above {DIVERGE_FACTOR:g}x "
              "its lowest value so far")
SUGGESTION = (f"the start of the valley, the smallest lr at which the smoothed loss has made "
              f"{FALL_DONE:.0%} of its fall to its lowest value")


def check_range(start_lr: float, end_lr: float, steps: int) -> None:
    """One clear error for a ramp that cannot run."""
    if not (math.isfinite(start_lr) and start_lr > 0):
        raise ConfigError(f"--start-lr must be a positive number, got {start_lr}")
    if not (math.isfinite(end_lr) and end_lr > start_lr):
        raise ConfigError(f"--end-lr ({end_lr}) must be larger than --start-lr ({start_lr})")
    if steps < MIN_STEPS:
        raise ConfigError(f"--steps must be at least {MIN_STEPS} (a ramp needs enough points "
                          f"to smooth), got {steps}")


def beta_for(steps: int) -> float:
    """The running average's β for a ramp of `steps` points: memory 1/(1−β) = steps/10."""
    return max(0.0, 1.0 - 1.0 / (MEMORY * steps))


def ramp_lr(step: int, start_lr: float, end_lr: float, steps: int) -> float:
    """The lr of update `step` (0-based): start_lr at 0, end_lr at steps - 1, a constant
    factor between neighbours."""
    return start_lr * (end_lr / start_lr) ** (min(step, steps - 1) / (steps - 1))


@dataclass
class RangeTest:
    """The points of a range test, their smoothing, and the stop and suggestion rules."""

    beta: float = 0.9  # beta_for(100)
    factor: float = DIVERGE_FACTOR
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    _avg: float = 0.0

    def add(self, lr: float, loss: float) -> bool:
        """Record one point; True when the test must stop (divergence)."""
        self.lrs.append(lr)
        self.losses.append(loss)
        if not math.isfinite(loss):
            self.stop_reason = f"the loss is {loss} at lr {lr:.3g}"
            return True
        self._avg = self.beta * self._avg + (1 - self.beta) * loss
        s = self._avg / (1 - self.beta ** (len(self.smoothed) + 1))
        self.smoothed.append(s)
        best = min(self.smoothed)
        if s > self.factor * best:
            self.stop_reason = (f"the running (lagging) average of the loss, {s:.4g} at lr "
                                f"{lr:.3g}, exceeds {self.factor:g}x its lowest value "
                                f"{best:.4g}")
            return True
        return False

    def zero_lag(self) -> list[float]:
        """The finished curve smoothed without lag: the running average's rule applied
        forward, then backward over its result."""
        return _ema(_ema(self.smoothed_input(), self.beta)[::-1], self.beta)[::-1]

    def smoothed_input(self) -> list[float]:
        return self.losses[:len(self.smoothed)]  # without a final non-finite loss

    def best_index(self) -> int | None:
        """Index of the lowest lag-free smoothed loss; None when it never fell below its
        first value (the ramp started too high to see any learning)."""
        z = self.zero_lag()
        if not z:
            return None
        i = min(range(len(z)), key=z.__getitem__)
        return i if i > 0 else None

    def valley_index(self) -> int | None:
        """Index of the suggestion: the first point with FALL_DONE of the fall made."""
        lo = self.best_index()
        if lo is None:
            return None
        z = self.zero_lag()
        threshold = z[lo] + (1 - FALL_DONE) * (z[0] - z[lo])
        return next(i for i in range(lo + 1) if z[i] <= threshold)

    def suggestion(self) -> float | None:
        i = self.valley_index()
        return None if i is None else self.lrs[i]


def _ema(xs: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (the running smoothing of `add`)."""
    out, avg = [], 0.0
    for t, x in enumerate(xs, 1):
        avg = beta * avg + (1 - beta) * x
        out.append(avg / (1 - beta ** t))
    return out


def range_test_config(cfg: Config, steps: int) -> Config:
    """The run's config for a range test in `<run_dir>/lr-find`: the same model, data,
    stage and precision; no checkpoints, evaluations or extra trackers; no schedule (the
    ramp replaces it); no spike guard (it would skip the very steps that show divergence)
    and no injected faults. A folder left by an earlier range test is replaced."""
    d = cfg.to_dict()
    d["logging"].update(run_dir=str(Path(cfg.logging.run_dir) / "lr-find"), overwrite=True,
                        backends=["jsonl"], plot=False, eval_every=0, sample_tokens=0)
    d["checkpoint"].update(dir=None, every=0)  # never the run's own checkpoint folder
    d["schedule"] = {"kind": "constant", "warmup_steps": 0, "min_lr": 0.0}
    d["train"]["steps"] = steps
    d["train"]["spike_guard"]["enabled"] = False
    d["train"]["fault"]["step"] = None
    return build_config(d)


def lr_find(cfg: Config, *, start_lr: float = 1e-5, end_lr: float = 1.0,
            steps: int = 100) -> dict[str, Any]:
    """Run the range test on every rank; rank 0 writes and prints. Returns the result
    record (also written to lr_find.json)."""
    from zerotrain.comm.dist import patient_barrier
    from zerotrain.run.loop import train_step
    from zerotrain.run.setup import setup

    check_range(start_lr, end_lr, steps)
    run = setup(range_test_config(cfg, steps), resume=None)
    eng, report = run.engine, run.report
    eng.lr_override = lambda s: ramp_lr(s, start_lr, end_lr, steps)
    report.say(f"[zerotrain] lr-find: lr from {start_lr:g} to {end_lr:g} over {steps} steps "
               f"(exponential), {run.dist.world_size} rank(s), {eng.strategy.name}; no "
               f"checkpoints; output in {run.run_dir}")
    test, prev_lr, first_loss = RangeTest(beta=beta_for(steps)), None, math.nan
    while eng.global_step < steps:
        sinfo, loss, dt = train_step(run)
        loss = float(eng.comm.all_reduce_scalars(loss.reshape(1))[0]) / run.dist.world_size
        report.train_step({"type": "train", "step": eng.global_step, "loss": loss,
                           "lr": sinfo.lr, "grad_norm": sinfo.grad_norm,
                           "tokens_per_s": run.global_tokens / dt, "step_time_s": dt,
                           "loss_scale": sinfo.loss_scale,
                           "skipped_total": sinfo.skipped_total}, eng.policy.loss_scaling)
        report.advance()
        if prev_lr is None:
            first_loss = loss
        elif test.add(prev_lr, loss):  # every rank sees the same loss: all stop together
            break
        prev_lr = sinfo.lr
    report.close_bar()
    result = _result(test, cfg, start_lr, end_lr, steps, eng.global_step, first_loss)
    if report.enabled:
        (run.run_dir / "lr_find.json").write_text(json.dumps(result, indent=1))
        plot_range_test(result, run.run_dir / "lr_find.png")
    for line in summary_lines(result, run.run_dir):
        report.say(line)
    report.close()
    patient_barrier()  # rank 0 wrote the results and plot alone
    eng.close()
    return result


def _result(test: RangeTest, cfg: Config, start_lr: float, end_lr: float, steps: int,
            steps_run: int, first_loss: float) -> dict[str, Any]:
    i, z = test.best_index(), test.zero_lag()
    return {
        "type": "lr_find", "start_lr": start_lr, "end_lr": end_lr, "steps": steps,
        "steps_run": steps_run,
        # a point pairs one step's lr with the loss measured at the next step, so the
        # first step gives `initial_loss` and no point: points = steps_run - 1
        "points": len(test.lrs), "diverged": test.stop_reason is not None,
        "stop_reason": test.stop_reason, "initial_loss": first_loss,
        "smoothing": SMOOTHING, "beta": test.beta, "divergence": DIVERGENCE,
        "rule": SUGGESTION,
        "lr_at_min": None if i is None else test.lrs[i],
        "min_smoothed_loss": None if i is None else z[i],
        "suggested_lr": test.suggestion(), "configured_lr": cfg.optimizer.lr,
        "lrs": test.lrs, "losses": test.losses, "smoothed_running": test.smoothed,
        "smoothed": z,
    }


def summary_lines(result: dict[str, Any], out_dir: Path) -> list[str]:
    """What the command prints at the end: how it stopped, the suggestion and its rule."""
    r, p = result, "[zerotrain] lr-find:"
    if r["diverged"]:
        head = f"{p} stopped after {r['steps_run']} of {r['steps']} steps: {r['stop_reason']}"
    else:
        head = (f"{p} ran all {r['steps']} steps without diverging (up to lr "
                f"{r['end_lr']:g}); a higher --end-lr shows where it does")
    lines = [head]
    if r["suggested_lr"] is None:
        lines.append(f"{p} the smoothed loss never fell below its first value: no suggestion; "
                     "lower --start-lr")
    else:
        last = r["lr_at_min"] == r["lrs"][len(r["smoothed"]) - 1]
        lines.append(
            f"{p} suggested peak lr {r['suggested_lr']:.3g} (configured optimizer.lr "
            f"{r['configured_lr']:g}); valley floor of the lag-free smoothed curve "
            f"(which also averages in the points after it): {r['min_smoothed_loss']:.4f} at "
            f"lr {r['lr_at_min']:.3g}"
            + ("; the loss was still falling at the end of the ramp: raise --end-lr to see "
               "the valley" if last else ""))
        lines.append(f"{p} rule: {r['rule']}")
    lines.append(f"{p} plot {out_dir / 'lr_find.png'}, data {out_dir / 'lr_find.json'}")
    return lines


def plot_range_test(result: dict[str, Any], path: Path) -> None:
    """Loss against lr (log x): raw and lag-free smoothed, the lowest point, the
    suggestion and the configured lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result
    fig, ax = plt.subplots(figsize=(8, 5))
    finite = [(lr, loss) for lr, loss in zip(r["lrs"], r["losses"]) if math.isfinite(loss)]
    if finite:
        ax.plot(*zip(*finite), c="C0", alpha=0.35, lw=1, label="loss")
    ax.plot(r["lrs"][:len(r["smoothed"])], r["smoothed"], c="C0", label="smoothed loss")
    if r["suggested_lr"] is not None:
        ax.plot([r["lr_at_min"]], [r["min_smoothed_loss"]], "o", c="C3",
                label=f"valley floor (lr {r['lr_at_min']:.3g})")
        ax.axvline(r["suggested_lr"], c="C2", ls="--",
                   label=f"suggested peak lr {r['suggested_lr']:.3g}")
    ax.axvline(r["configured_lr"], c="gray", ls=":",
               label=f"configured optimizer.lr {r['configured_lr']:g}")
    if r["smoothed"]:  # keep the divergence from flattening the interesting part
        lo = min([*r["smoothed"], *(loss for _, loss in finite)])
        top = max(r["smoothed"][0], min(r["smoothed"])) * 1.5
        ax.set_ylim(lo - 0.05 * abs(lo), top + 1e-9)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("lr range test: suggested peak = start of the valley "
                 f"({FALL_DONE:.0%} of the fall made)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
