"""The loss-spike guard: skip an optimizer step whose loss or gradient norm is an outlier.

A single bad batch (corrupt data, a rare token burst) can throw a run's weights far
enough to cost thousands of steps. With `train.spike_guard.enabled`, a step is skipped
when its loss or global gradient norm lies more than `zscore` standard deviations above
the mean of the last `window` accepted steps. Both inputs are already identical on every
rank (the loss is all-reduced, the norm is global), so every rank decides the same.
Skipped values are not added to the window, so one spike cannot mask the next.
"""

from __future__ import annotations

import math
from collections import deque

from zerotrain.config import SpikeGuardConfig


class SpikeGuard:
    def __init__(self, cfg: SpikeGuardConfig):
        self.cfg = cfg
        self.history: dict[str, deque[float]] = {
            "loss": deque(maxlen=cfg.window), "grad_norm": deque(maxlen=cfg.window)}
        self.skipped = 0

    def zscore(self, name: str, value: float) -> float:
        h = self.history[name]
        if len(h) < max(5, h.maxlen // 2):  # too few samples for a spread yet
            return 0.0
        mean = sum(h) / len(h)
        std = math.sqrt(sum((x - mean) ** 2 for x in h) / (len(h) - 1))
        return (value - mean) / max(std, 1e-12 * max(abs(mean), 1.0))

    def check(self, loss: float, grad_norm: float) -> str | None:
        """None to accept the step (and remember it), else the reason to skip it."""
        values = {"loss": loss, "grad_norm": grad_norm}
        for name, v in values.items():
            z = self.zscore(name, v)
            if z > self.cfg.zscore:
                self.skipped += 1
                return f"{name} {v:.4g} is {z:.1f} standard deviations above the recent mean"
        for name, v in values.items():
            self.history[name].append(v)
        return None

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.history.items()} | {"skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        for k in self.history:
            self.history[k].clear()
            self.history[k].extend(sd.get(k, []))
        self.skipped = int(sd.get("skipped", 0))
