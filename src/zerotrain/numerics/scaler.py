"""Loss scaling for FP16, and the skip bookkeeping every precision shares.

FP16's smallest subnormal is 2^-24: gradients below it flush to zero. Multiplying the
loss by S shifts every gradient up by S (exactly, S is a power of two); the engine
divides by S again before clipping and the update. Dynamic scaling finds the largest
safe S: halve it when a gradient overflows (after `hysteresis` overflows in a row),
double it after `window` clean steps. An overflowing step is skipped whatever the
precision, so a NaN from bad data never reaches the weights.
"""

from __future__ import annotations

from zerotrain.config import LossScaleConfig


class LossScaleError(RuntimeError):
    pass


class LossScaler:
    def __init__(self, cfg: LossScaleConfig, enabled: bool):
        self.cfg = cfg
        self.enabled = enabled
        self.dynamic = enabled and cfg.kind == "dynamic"
        self.scale = float(cfg.init_scale) if enabled else 1.0
        self.good_steps = 0
        self.hysteresis_left = cfg.hysteresis
        self.skipped = 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome; adjust the scale if dynamic."""
        if overflow:
            self.skipped += 1
            self.overflows += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            new = self.scale / 2
            if new < self.cfg.min_scale:
                if self.cfg.on_min_scale == "error":
                    raise LossScaleError(
                        f"fp16 loss scale would fall below precision.loss_scale.min_scale "
                        f"({self.cfg.min_scale}): gradients overflow even barely scaled. Lower "
                        "optimizer.lr, use precision.dtype bf16, or set "
                        "precision.loss_scale.on_min_scale clamp"
                    )
                new = self.cfg.min_scale
            self.scale = new
            self.hysteresis_left = self.cfg.hysteresis
            return
        if not self.dynamic:
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.window:
            self.scale *= 2
            self.good_steps = 0
            self.hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped": self.skipped,
            "overflows": self.overflows,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.hysteresis_left = int(sd["hysteresis_left"])
        self.skipped = int(sd["skipped"])
        self.overflows = int(sd["overflows"])
