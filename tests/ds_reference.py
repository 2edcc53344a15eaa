"""DeepSpeed's learning-rate schedulers, transcribed from its documentation: the
independent reference for tests/test_deepspeed_*.py. `s` is the scheduler's
last_batch_iteration; W is max(2, warmup_num_steps), as DeepSpeed clamps it."""

from __future__ import annotations

import math

from zerotrain.config import Config
from zerotrain.optim.schedule import lr_from_config


def ds_gamma(s: int, w: int, wtype: str) -> float:
    return math.log(s + 1) / math.log(w) if wtype == "log" else s / w


def ds_warmup_lr(s, lo, hi, w, wtype):
    return lo + (hi - lo) * (ds_gamma(s, w, wtype) if s < w else 1.0)


def ds_warmup_decay_lr(s, lo, hi, w, total, wtype):
    g = ds_gamma(s, w, wtype) if s < w else max(0.0, (total - s) / max(1.0, total - w))
    return lo + (hi - lo) * g


def ds_warmup_cosine_lr(s, lr, w, total, r0, rc, wtype):
    if s < w:
        ratio = r0 + (1.0 - r0) * ds_gamma(s, w, wtype)
    else:
        progress = min(1.0, (s - w + 1) / max(1, total - w))
        ratio = max(0.0, rc + (1.0 - rc) * (1 + math.cos(math.pi * progress)) / 2)
    return lr * ratio


def curve(cfg: Config, steps: range) -> list[float]:
    """The lr the engine uses for update s+1, through the same call the engine makes."""
    return [lr_from_config(s, cfg.schedule, cfg.optimizer.lr, cfg.train.steps) for s in steps]
