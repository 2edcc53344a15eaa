"""Where a meta-device unit's first values come from: one part of a strategy, chosen once.

The builder picks it from what the engine knows (pretrained weights coming or not); the
strategy only calls `fill(u)` after a unit's buffer exists, and ZeRO-3 asks `per_name`
whether it may draw one parameter at a time straight into its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from zerotrain.models.plan import Plan

if TYPE_CHECKING:
    from zerotrain.zero.unit import Unit


@dataclass(frozen=True)
class InitValues:
    """The plan's rule (`Plan.init`: a function of seed and name, so the values equal the
    eagerly built model's), else each module's `reset_parameters()`; nothing when
    `skip` (pretrained weights fill the units next)."""

    model: nn.Module
    plan: Plan
    skip: bool = False

    @property
    def per_name(self) -> bool:
        """Values come from the plan's per-name rule: any piece can be drawn alone."""
        return self.plan.init is not None and not self.skip

    def fill(self, u: Unit) -> None:
        """Initial values of a unit built on the meta device, written into its buffer."""
        if self.skip:
            return
        if self.plan.init is not None:
            for s in u.slots:
                self.plan.init(s.name, s.param.data)
            return
        mine = {id(s.param) for s in u.slots}
        for m in self.model.modules():
            if any(id(p) in mine for p in m.parameters(recurse=False)):
                reset = getattr(m, "reset_parameters", None)
                if reset is None:
                    raise ValueError(f"module {type(m).__name__} was built on the meta device "
                                     "but has no reset_parameters() and the model's plan "
                                     "gives no init rule; build it on a real device")
                reset()
