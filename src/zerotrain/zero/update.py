"""How the optimizer's step meets the master weights: one part of a strategy, chosen once.

The strategy keeps the units, the gradients and the traffic; the updater says what the
optimizer sees (`views`, `param_groups`) and how one step runs (`step`):

- `Elementwise`: attach every owned gradient, one `optimizer.step()`, detach. The views
  are one flat run per (unit, group), or one tensor per parameter (`per_param`: a rule
  that needs shapes, at a stage that does not shard it).
- `UnitByUnit` (Offload on a GPU): the same elementwise update, one unit at a time, each
  unit published as soon as the CPU has updated it, so its host-to-device copy (and,
  below ZeRO-3, its all-gather) runs while the CPU updates the next one.
- `MatrixOwners` (zero/muon.py): each matrix updated whole by one owner rank.

The builder (`zero/__init__.py`) picks one from the facts it depends on; the strategy
never asks which.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotrain.zero.flat import Segment

Views = list[tuple[Segment, Tensor]]


class Updater:
    """The elementwise update: every owned gradient attached, one step."""

    per_param = False
    publishes = False  # True: `step` publishes every unit itself (after_step does not)

    def __init__(self, strategy: Any):
        """`strategy`: the `zero.base.Strategy` this updates (untyped: base imports this
        module) — its units, `opt_range`, `opt_segments`, `attach_grads`, `publish`."""
        self.s = strategy

    def views(self) -> Views:
        """(segment, master view) per optimizer tensor, in optimizer order (by group:
        checkpoints rely on it)."""
        s, out = self.s, []
        for u in s.units:
            lo, hi = s.opt_range(u)
            for seg in u.segments(lo, hi, per_param=self.per_param):
                view = u.master[seg.start - lo:seg.end - lo]
                if seg.param is not None:
                    view = view.view(seg.param.shape)
                # where the view starts in the model (unit, offset): stochastic rounding
                # draws each element's bits from it, so any cut rounds alike
                view.zt_origin = (u.index << 40) + seg.start
                out.append((seg, view))
        return sorted(out, key=lambda sv: sv[0].group)

    def param_groups(self, groups: list[dict], options: dict[int, dict]) -> list[dict]:
        return groups

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.s.attach_grads()
        optimizer.step()
        self.s.detach_grads()

    def describe(self) -> str | None:
        """One line for the run's start, or None when there is nothing to say."""
        return None

    def resident(self) -> None:
        """Bring what the optimizer keeps in a tier back to memory (before a checkpoint
        reads or writes it; `zero.infinity.Streamed`). Here: it is in memory already."""

    def summary(self) -> dict[str, Any] | None:
        return None


class Elementwise(Updater):
    pass


class PerParameter(Elementwise):
    """Elementwise over one full-shape tensor per parameter (Muon at stage 0)."""

    per_param = True


class UnitByUnit(Updater):
    """Offload on a GPU: step and publish one unit at a time (the module docstring)."""

    publishes = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        s = self.s
        by_unit: dict[int, Views] = {}
        for seg, view in s.opt_segments:
            by_unit.setdefault(seg.unit, []).append((seg, view))
        for u in s.units:
            if u.index in by_unit:
                s.attach_grads(by_unit[u.index])
                optimizer.step()
                s.detach_grads()
            s.publish(u)

