"""ZeRO-Infinity: ZeRO-3's parameter shards and the optimizer's states in an offload tier.

Two parts, each over a `Tier` (zero/tier.py):

- `ParamTier` (`zero.offload_param`): each unit's parameter shard lives in the tier
  between uses. Before a unit's gather the shard is made ready (its load was started
  `zero.offload_prefetch` units earlier, so it ran while those units computed), the
  gather reads it, and the shard's memory is released at once — it is clean, the tier
  holds the same bytes. After the optimizer step the new shard is written whole into
  fresh memory (no read) and written back behind the next units' updates.
- `Streamed` (`zero.offload_optimizer: nvme`): an updater that steps unit by unit with
  each unit's master weights and optimizer moments in the tier: the units ahead are
  read while one updates (read-ahead of `offload_prefetch`, at least 1: double
  buffering), and each updated unit is written back while the next updates (write
  behind); at most prefetch + 2 units' states are in memory at once. The gradients stay
  where ZeRO-Offload keeps them.

Persistent units (under `zero.param_persistence_threshold`) keep their shard: it is a
view of their gathered buffer. Checkpoints see the same tensors as without a tier
(`resident`: brought back before a save or load), so the format is tier-independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from zerotrain.zero.tier import Placed, Tier
from zerotrain.zero.update import UnitByUnit, Views

#: the most optimizer state per parameter among zerotrain's elementwise rules, in units
#: of the fp32 master (RMSprop centered with momentum: 12 bytes): the disk reserved
STATE_PER_MASTER = 3


class ParamTier:
    """Where ZeRO-3's parameter shards live between uses (see the module docstring)."""

    def __init__(self, tier: Tier, depth: int):
        self.tier, self.depth = tier, depth
        self.placed: dict[int, Placed] = {}
        self.loads: list[tuple[int, Any]] = []  # (unit index, IOHandle) of this step

    @property
    def moves(self) -> bool:
        return self.tier.moves

    def attach(self, units: Sequence[Any]) -> None:
        """Give every non-persistent unit's shard a home in the tier and send it there."""
        if not self.tier.moves:
            return
        self.tier.require(sum(_padded(u.shard) for u in units if not u.persistent))
        for u in units:
            if not u.persistent:
                self.placed[u.index] = Placed(self.tier, f"unit{u.index}.shard", u.shard)
        self.evict_all()

    def fetch(self, u: Any) -> None:
        p = self.placed.get(u.index) if u is not None else None
        if p is not None and not p.resident:
            p.fetch()
            if p.loading is not None:
                self.loads.append((u.index, p.loading))

    def ready(self, u: Any) -> None:
        p = self.placed.get(u.index)
        if p is not None:
            self.fetch(u)
            p.ready()

    def release(self, u: Any) -> None:
        """The gather has read the shard: drop it (clean, so no write)."""
        p = self.placed.get(u.index)
        if p is not None:
            p.evict()
            p.settle()

    def overwrite(self, u: Any) -> None:
        """Memory for a shard about to be written whole (the publish): no read."""
        p = self.placed.get(u.index)
        if p is not None and not p.resident:
            p.settle()
            p.t.untyped_storage().resize_(p.t.numel() * p.t.element_size())
            p.resident = True
        if p is not None:
            p.dirty = True

    def written(self, u: Any) -> None:
        """The publish wrote the shard: send it back (write behind)."""
        p = self.placed.get(u.index)
        if p is not None:
            p.evict()

    def evict_all(self) -> None:
        for p in self.placed.values():
            p.evict()
        self.settle_all()

    def settle_all(self) -> None:
        for p in self.placed.values():
            p.settle()


def _padded(t: Tensor) -> int:
    return -(-t.numel() * t.element_size() // 4096) * 4096


class Streamed(UnitByUnit):
    """The optimizer step with masters and moments streamed from a tier, unit by unit."""

    def __init__(self, strategy: Any):
        super().__init__(strategy)
        s = strategy
        self.tier: Tier = s.opt_tier
        self.depth = max(1, s.cfg.offload_prefetch)
        self.masters: dict[int, Placed] = {}
        self.states: dict[tuple[int, int, str], Placed] = {}  # (unit, view #, name)
        self.tier.require(sum(_padded(u.master) for u in s.units) * (1 + STATE_PER_MASTER))
        for u in s.units:
            self.masters[u.index] = Placed(self.tier, f"unit{u.index}.master", u.master)

    def views(self) -> Views:
        """The optimizer's views of the masters, then the masters to their tier (the views
        stay valid: the storage is refilled in place)."""
        out = super().views()
        for p in self.masters.values():
            p.evict()
        for p in self.masters.values():
            p.settle()
        return out

    def describe(self) -> str | None:
        return (f"optimizer states streamed from the {self.tier.kind} tier unit by unit "
                f"({self.depth} unit(s) read ahead, written behind)")

    # ------------------------------------------------------------ residency
    def _placed(self, u: Any) -> list[Placed]:
        return [self.masters[u.index]] + [p for (i, _, _), p in self.states.items()
                                          if i == u.index]

    def _bind_states(self, u: Any, views: Views) -> None:
        """Track the optimizer's tensors of `u`'s views (made at their first step, or
        replaced by a checkpoint load) as placed tensors that own their storage."""
        opt = self.s._optimizer
        for j, (_, view) in enumerate(views):
            for name, t in list(opt.state.get(view, {}).items()):
                if not isinstance(t, Tensor) or t.numel() != view.numel() or t.numel() <= 1:
                    continue
                key = (u.index, j, name)
                p = self.states.get(key)
                if p is not None and p.t is t:
                    continue
                st = t.untyped_storage()  # a loaded checkpoint's: a view, or not resizable
                if t.storage_offset() or st.nbytes() != t.nbytes or not st.resizable():
                    t = t.clone()
                    opt.state[view][name] = t
                if p is None:
                    self.states[key] = Placed(self.tier, f"unit{u.index}.{j}.{name}", t)
                else:  # same home in the tier, new tensor
                    p.t, p.resident, p.dirty = t, True, True

    def fetch(self, u: Any) -> None:
        for p in self._placed(u):
            p.fetch()

    def ready(self, u: Any) -> None:
        for p in self._placed(u):
            p.ready()

    def evict(self, u: Any) -> None:
        for p in self._placed(u):
            p.dirty = True
            p.evict()

    def settle(self, u: Any) -> None:
        self.s.fence_master(u)  # an asynchronous publish (GPU) has read the master
        for p in self._placed(u):
            p.settle()

    def resident(self) -> None:
        """Everything in memory (a checkpoint save or load, a norm check): the next step
        sends it back."""
        s = self.s
        by_unit = self._by_unit()
        for u in s.units:
            if u.index in by_unit and getattr(s, "_optimizer", None) is not None:
                self._bind_states(u, by_unit[u.index])
            self.fetch(u)
        for u in s.units:
            self.ready(u)
            for p in self._placed(u):
                p.dirty = True

    def _by_unit(self) -> dict[int, Views]:
        by_unit: dict[int, Views] = {}
        for seg, view in self.s.opt_segments:
            by_unit.setdefault(seg.unit, []).append((seg, view))
        return by_unit

    # ------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        s = self.s
        s._optimizer = optimizer
        by_unit = self._by_unit()
        order = list(s.units)
        for u in order:  # states replaced by a load since the last step
            if u.index in by_unit:
                self._bind_states(u, by_unit[u.index])
        for u in order[:self.depth]:
            self.fetch(u)
        for k, u in enumerate(order):
            if k + self.depth < len(order):
                self.fetch(order[k + self.depth])  # read ahead
            self.ready(u)
            if u.index in by_unit:
                s.attach_grads(by_unit[u.index])
                optimizer.step()
                s.detach_grads()
                self._bind_states(u, by_unit[u.index])  # first step: new moments
            s.publish(u)
            self.evict(u)  # write behind
            if k >= 1:
                self.settle(order[k - 1])
        for u in order[-1:]:
            self.settle(u)
