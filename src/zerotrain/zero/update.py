"""How the optimizer's step meets the master weights: one part of a strategy, chosen once.

The strategy keeps the units, the gradients and the traffic; the updater says what the
optimizer sees (`views`, `param_groups`) and how one step runs (`step`):

- `Elementwise`: attach every owned gradient, one `optimizer.step()`, detach. The views
  are one flat run per (unit, group), or one tensor per parameter (`per_param`: a rule
  that needs shapes, at a stage that does not shard it).
- `UnitByUnit` (Offload on a GPU, and the disk home): the same elementwise update, one
  unit at a time, each unit published as soon as the CPU has updated it, so its
  host-to-device copy (and, below ZeRO-3, its all-gather) runs while the CPU updates the
  next one. Through the home's residency hooks (zero/states/home.py; no-ops but on the
  disk) the units ahead are read while one updates and each is written back behind.
- `MatrixOwners` (zero/muon.py): each matrix updated whole by one owner rank.

The builder (`zero/__init__.py`) picks one from the facts it depends on; the strategy
never asks which.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotrain.zero.flat import Segment
from zerotrain.zero.unit import Unit

Views = list[tuple[Segment, Tensor]]


class StepView:
    """What an updater may use of the strategy that owns it, and nothing else: the units,
    the optimizer's views, the home, where tensors live and who the ranks are, and the
    strategy's gradient and publish verbs. A proxy, so a part never holds the strategy."""

    __slots__ = ("_s",)

    def __init__(self, strategy: Any):
        self._s = strategy.view() if isinstance(strategy, StepView) else strategy

    def view(self) -> Any:
        return self._s

    units = property(lambda self: self._s.units)
    opt_segments = property(lambda self: self._s.opt_segments)
    placement = property(lambda self: self._s.placement)  # the home: residency hooks
    comm = property(lambda self: self._s.comm)
    device = property(lambda self: self._s.device)
    host = property(lambda self: self._s.host)
    rank = property(lambda self: self._s.rank)
    world = property(lambda self: self._s.world)

    def opt_range(self, u: Unit) -> tuple[int, int]:
        return self._s.opt_range(u)

    def owned_grad(self, u: Unit) -> Tensor:
        return self._s.owned_grad(u)

    def attach_grads(self, segments: Views | None = None) -> None:
        self._s.attach_grads(segments)

    def detach_grads(self) -> None:
        self._s.detach_grads()

    def publish(self, u: Unit) -> None:
        self._s.publish(u)

    def fence_master(self, u: Unit) -> None:
        self._s.fence_master(u)


class Updater:
    """The elementwise update: every owned gradient attached, one step."""

    per_param = False
    publishes = False  # True: `step` publishes every unit itself (after_step does not)

    def __init__(self, strategy: Any):
        """`strategy`: the `zero.base.Strategy` this updates, seen through a `StepView`."""
        self.s = StepView(strategy)

    def views(self) -> Views:
        """(segment, master view) per optimizer tensor, in optimizer order (by group:
        checkpoints rely on it)."""
        s, out = self.s, []
        with s.placement.sized():  # masters away in a tier: sized while cut
            for u in s.units:
                lo, hi = s.opt_range(u)
                for seg in u.segments(lo, hi, per_param=self.per_param):
                    view = u.master[seg.start - lo:seg.end - lo]
                    if seg.param is not None:
                        view = view.view(seg.param.shape)
                    # where the view starts in the model (unit, offset): stochastic
                    # rounding draws each element's bits from it, so any cut rounds alike
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

    def summary(self) -> dict[str, Any] | None:
        return None


class Elementwise(Updater):
    pass


class PerParameter(Elementwise):
    """Elementwise over one full-shape tensor per parameter (Muon at stage 0)."""

    per_param = True


class UnitByUnit(Updater):
    """Step and publish one unit at a time (the module docstring)."""

    publishes = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        s, home = self.s, self.s.placement
        by_unit = home.by_unit
        order = list(s.units)
        for u in order:  # states replaced by a load since the last step
            home.bind(u)
        d = home.depth
        for u in order[:d]:
            home.fetch(u, grad=True)
        for k, u in enumerate(order):
            if k + d < len(order):
                home.fetch(order[k + d], grad=True)  # read ahead
            home.ready(u, grad=True)
            if u.index in by_unit:
                s.attach_grads(by_unit[u.index])
                optimizer.step()
                s.detach_grads()
                home.bind(u)  # first step: new moments
            s.publish(u)
            home.evict(u)  # write behind
            if k >= 1:
                home.settle(order[k - 1])
        for u in order[-1:]:
            home.settle(u)
