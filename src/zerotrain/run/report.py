"""What a training run tells its user: metrics file, progress bar, lines, curves.

Only rank 0 reports; every other rank gets a Reporter that does nothing, so the loop
in `loop.py` never asks which rank it is. Every rank still calls every method at the same
point of the run, because a few lines read numbers that all ranks compute together.
The text of each line is here: the start (ranks, strategy, model-state bytes, a CPU's
cost), a logged step, the peak memory per phase, and the end of a run.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain.config import Config
from zerotrain.memory import config_activations
from zerotrain.models import active_param_count
from zerotrain.models.moe_parallel import describe as describe_ep
from zerotrain.models.moe_parallel import whole_numel
from zerotrain.optim.schedule import lr_from_config
from zerotrain.run.curves import Series, curve_series, plot_curves
from zerotrain.run.trackers import make_trackers

if TYPE_CHECKING:
    from zerotrain.engine import Engine, StepInfo
    from zerotrain.run.fit import Fit

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
        self.phases_said = False  # the peak-memory line has been printed
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
        if "moe" in rec:  # the busiest expert's tokens over the mean (1.00 = balanced)
            post["moe imb"] = f"{rec['moe']['imbalance']:.2f}"
            post["aux"] = f"{rec['moe']['aux_loss']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            return
        now, total = time.monotonic(), self.cfg.train.steps
        if now - self._last_line >= LINE_EVERY_S or rec["step"] >= total:
            self._last_line = now
            print(f"step {rec['step']}/{total}: "
                  + ", ".join(f"{k} {v}" for k, v in post.items()), file=sys.stderr,
                  flush=True)

    def start(self, eng: Engine, world: int) -> None:
        """Before the first step: ranks, strategy, parameters, the model states' bytes,
        distributed Muon's owners, and a warning when a CPU step would take minutes."""
        mem = eng.memory_report()
        self.record({"type": "memory", "step": eng.global_step, **mem})
        ms = mem["model_states"]
        n_params = whole_numel(eng.module)  # expert parallelism: every rank's experts
        active = active_param_count(self.cfg.model) if self.enabled else n_params
        moe = f" ({active:,} active per token)" if active != n_params else ""
        self.say(f"[zerotrain] {world} rank(s), {eng.strategy.name}, "
                 f"{n_params:,} params{moe}, {eng.policy.describe()}")
        held = ", ".join(f"{place} {k}={v:,}" for place in ("device", "host")
                         for k, v in ms[place].items() if v)
        self.say("[zerotrain] model states on rank 0 (bytes): "
                 + (held or "none resident between steps (in the offload tiers below)"))
        ep = describe_ep(eng.module)
        for line in ([ep] if ep else []) + eng.strategy.describe():  # e.g. Muon's owners
            self.say(f"[zerotrain] {line}")
        if eng.device.type == "cpu":
            warning = cpu_cost_warning(self.cfg, n_params)
            if warning:
                self.say(warning)

    def log_step(self, eng: Engine, sinfo: StepInfo, loss: float, tokens_per_s: float,
                 dt: float, moe: dict | None = None) -> None:
        """A logged step: its record, and the progress bar's numbers (`moe`: the routers'
        record since the last logged step, models/moe.py)."""
        rec = {"type": "train", "step": eng.global_step, "loss": loss, "lr": sinfo.lr,
               "grad_norm": sinfo.grad_norm, "tokens_per_s": tokens_per_s,
               "step_time_s": dt, "loss_scale": sinfo.loss_scale,
               "skipped_total": sinfo.skipped_total, "bytes_sent": eng.last_traffic_bytes[0],
               "inter_node_bytes_sent": eng.last_inter_bytes[0]}
        if eng.last_tier_bytes:  # offload tiers that move bytes (nvme): read/written this step
            rec["tier_bytes"] = eng.last_tier_bytes
        if sinfo.fp8 is not None:  # FP8 overflow/underflow counts per tensor class, this step
            rec["fp8"] = sinfo.fp8
        if moe is not None:
            rec["moe"] = moe
        self.train_step(rec, eng.policy.loss_scaling)

    def phases(self, eng: Engine) -> None:
        """Peak memory per phase against the model's prediction (rank 0's numbers)."""
        c = self.cfg
        # every family's activations are modelled (memory/activations.py)
        acts, modelled = config_activations(c, device=eng.device.type).peak, True
        ph = eng.memory_phases(acts)
        self.record({"type": "memory_phases", "step": eng.global_step,
                     "activations_modelled": modelled, **ph})
        # said once: after the first steps, or at the end of a run that never got there
        if not self.phases_said:
            self.phases_said = True
            self.say(phase_text(ph, modelled, eng.device.type == "cpu"))

    def finish(self, summary: dict[str, Any], fit: Fit, sample: str) -> None:
        """The end of a run: the summary record, curves.png, the sample, the result lines;
        then every tracker is closed."""
        self.record(summary)
        baseline, label = uniform_baseline(self.cfg.model.vocab_size)
        if self.cfg.logging.plot:
            self.plot(baseline, label)
        if sample and self.enabled:
            (self.run_dir / "sample.txt").write_text(sample)
            self.say("\n----- sample -----\n" + sample + "\n------------------")
        first, final = summary["first_val_loss"], summary["final_val_loss"]
        fv = f"{first:.4f} -> " if first is not None else ""
        self.say(f"[zerotrain] validation loss {fv}{final:.4f} ({label.split(' (')[0]} = "
                 f"{baseline:.4f}), {summary['final_val_bits_per_byte']:.4f} bits/byte; "
                 f"{fit.gap_text()}; {summary['steps_run']} steps in "
                 f"{summary['seconds']:.1f}s; checkpoint {summary['checkpoint']}; metrics "
                 f"{', '.join(self.log.where) or 'not written (logging.backends [])'}")
        self.say(fit.line())
        self.close()

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


#: what a CPU rank computes per second, roughly (a few cores of fp32 matmul)
CPU_FLOPS = 1e11


def cpu_cost_warning(cfg: Config, n_params: int) -> str | None:
    """A warning when one step would take minutes on a CPU: the matmuls (6 FLOPs per
    parameter per token) and attention, which grows with block_size² (12·L·h·s² per
    sequence, forward and backward). Said before the first step, which may never end."""
    m, d = cfg.model, cfg.data
    seqs = d.micro_batch_size * d.grad_accum_steps
    s, h, layers = m.block_size, m.n_embd or 0, m.n_layer or 0
    flops = 6 * n_params * seqs * s + 12 * layers * h * seqs * s * s
    seconds = flops / CPU_FLOPS
    if seconds < 60:
        return None
    return (f"[zerotrain] warning: one step is about {flops:.1e} FLOPs on each rank "
            f"(attention grows with model.block_size² = {s}²); at the ~{CPU_FLOPS:.0e} "
            f"FLOP/s of a CPU that is about {seconds / 60:.0f} min per step; lower "
            "model.block_size or data.micro_batch_size, or train on a GPU")


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
    low = ph.get("predicted_low") or predicted

    def pred(k: str) -> str:  # a range where freed memory may or may not stay (CPU)
        lo, hi = low[k] / mib, predicted[k] / mib
        return f"{hi:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"
    ranged = any(f"{low[k] / mib:.1f}" != f"{predicted[k] / mib:.1f}" for k in measured)
    how = ("; a range: the phase's own peak if freed memory returns to the OS, else the "
           "high-water mark of the phases before" if ranged else "")
    return (f"{head} (measured / predicted; the prediction counts tensors, not "
            f"{' or '.join(left_out)}{how}): "
            + ", ".join(f"{k} {v / mib:.1f} / {pred(k)}" for k, v in measured.items()))
