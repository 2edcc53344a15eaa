"""What a training run tells its user: metrics file, progress bar, lines, curves.

Only rank 0 reports; every other rank gets a Reporter that does nothing, so the loop
in `train.py` never asks which rank it is.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zerotrain.config import Config
from zerotrain.curves import Series, curve_series, plot_curves
from zerotrain.optim.schedule import lr_from_config
from zerotrain.trackers import make_trackers

#: how often a log file (stderr not a terminal) gets a progress line, at most
LINE_EVERY_S = 30.0


class Reporter:
    """Progress bar, one-line messages and the metrics log of one run (rank 0 only)."""

    def __init__(self, cfg: Config, run_dir: Path, rank: int, start_step: int,
                 resume_step: int | None):
        self.run_dir, self.enabled, self.cfg = run_dir, rank == 0, cfg
        # every configured backend (jsonl, csv, TensorBoard, W&B); nothing off rank 0
        self.log = make_trackers(cfg, run_dir, rank, resume_step)
        self.bar = None
        # a log file gets a plain line now and then instead of a bar's \r redraws (a
        # notebook's output is no terminal either, but it draws \r the way one does)
        redraws = sys.stderr.isatty() or "ipykernel" in sys.modules
        self.lines = self.enabled and cfg.logging.progress and not redraws
        self._last_line = -math.inf
        if self.enabled and cfg.logging.progress and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step",
                            dynamic_ncols=True)

    def say(self, line: str) -> None:
        """A line of output that does not tear the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def record(self, rec: dict) -> None:
        self.log(rec)

    def train_step(self, rec: dict, show_scale: bool) -> None:
        self.log(rec)
        if self.bar is None and not self.lines:
            return
        post = {"loss": f"{rec['loss']:.3f}", "lr": f"{rec['lr']:.2e}",
                "tok/s": f"{rec['tokens_per_s']:,.0f}", "gnorm": f"{rec['grad_norm']:.2f}",
                "skip": rec["skipped_total"]}
        if show_scale:
            post["scale"] = f"{rec['loss_scale']:g}"
        if "fp8" in rec:  # saturated (overflowing) FP8 values: input/weight/grad
            post["fp8 ovf"] = "/".join(str(v["overflow"]) for v in rec["fp8"].values())
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            return
        now, total = time.monotonic(), self.cfg.train.steps
        if now - self._last_line >= LINE_EVERY_S or rec["step"] >= total:
            self._last_line = now
            print(f"step {rec['step']}/{total}: "
                  + ", ".join(f"{k} {v}" for k, v in post.items()), file=sys.stderr,
                  flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @contextmanager
    def bar_closed_on_error(self) -> Iterator[None]:
        """An error (or Ctrl-C) inside ends the bar's line first, so the error's own line
        starts on a line of its own instead of glued to the bar."""
        try:
            yield
        except BaseException:
            self.close_bar()
            raise

    def close(self) -> None:
        """End of the run (also on interruption or failure): flush every tracker."""
        self.close_bar()
        self.log.close()

    def curve_data(self) -> Series:
        """What curves.png shows; its lr line is the schedule at every step."""
        c = self.cfg

        def lr(step: int) -> float:
            return lr_from_config(step, c.schedule, c.optimizer.lr, c.train.steps)

        return curve_series(self.log.records, lr, c.train.steps)

    def plot(self, baseline: float, baseline_label: str) -> None:
        if self.enabled and self.log.records:
            plot_curves(self.curve_data(), self.run_dir / "curves.png", baseline,
                        baseline_label)


def uniform_baseline(vocab_size: int) -> tuple[float, str]:
    """The loss of a uniform guess over the vocabulary, and its label."""
    return math.log(vocab_size), f"ln {vocab_size} (uniform guess)"


#: Below this predicted peak (MiB) a CPU rank's measurement is mostly the runtime's own
#: memory (kernels, thread pools, allocator arenas: 15-30 MiB at a first step, measured
#: on tiny GPT/llama runs), so a side-by-side would mislead (28 measured vs 2 predicted)
COMPARABLE_MIB = 64.0


def phase_text(ph: dict, activations_modelled: bool, cpu: bool) -> str:
    """The 'peak memory per phase' line: measured against predicted where they compare,
    saying what the prediction leaves out."""
    mib = 2**20
    measured, predicted = ph["measured"], ph["predicted"]
    head = "[zerotrain] peak memory per phase above start, MiB"
    most = max((predicted[k] for k in measured), default=0) / mib
    if cpu and most < COMPARABLE_MIB:
        return (f"{head} (measured): "
                + ", ".join(f"{k} {v / mib:.1f}" for k, v in measured.items())
                + f"; not compared with the model's prediction (at most {most:.1f} MiB of "
                "tensors): at this size the runtime's own memory (kernels, thread pools, "
                "allocator) dominates")
    left_out = ["activations"] if not activations_modelled else []
    left_out.append("the runtime's own memory (tens of MiB on a CPU)" if cpu
                    else "memory outside the allocator")
    return (f"{head} (measured / predicted; the prediction counts tensors, not "
            f"{' or '.join(left_out)}): "
            + ", ".join(f"{k} {v / mib:.1f} / {predicted[k] / mib:.1f}"
                        for k, v in measured.items()))
