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

import math
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
