"""ZeRO-3's parameter store: where each unit's shard lives between uses and how it travels.

The store holds what a unit's parameters need outside the stage's hooks: the wire a
gather travels in (plain, FP8 or int8: zero/params/wire.py), the post-forward partition
hpZ adds (zero/params/hpz.py) and the home tier of the shards (zero/params/tiered.py,
ZeRO-Infinity's `offload_param`). Each unit travels over its own partition's ranks
(`u.part.comm`: every rank, or an expert unit's expert-data-parallel group). ZeRO-3
(zero/zero3.py) only decides *when*: it calls `gather` before a unit runs, `release`
after its forward, `reduced` once its gradients are reduced, `publish` after its update
and `refresh` when every unit is published. The memory model reads what the store states
it holds: `resident_bytes` (between uses) and `landing_bytes` (while gathered).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.zero.params.hpz import SecondaryPartition
from zerotrain.zero.params.tiered import ParamTier
from zerotrain.zero.params.wire import PlainWire
from zerotrain.zero.tiers.tier import Tier
from zerotrain.zero.unit import ShardedUnit

#: the unit that runs after `u`, forward (True) or backward (False), or None
Neighbour = Callable[[ShardedUnit, bool], ShardedUnit | None]


class ParamStore:
    def __init__(self, comm: Comm, units: Sequence[ShardedUnit], wire: PlainWire,
                 tier: ParamTier | None = None, secondary: int | None = None,
                 prefetch: bool = True, itemsize: int = 4):
        """Collective (hpZ makes its groups). `secondary`: hpZ's group size K (None: off);
        `prefetch`: start the next unit's gather as one finishes (not with a moving tier,
        whose reads are the prefetch)."""
        self.comm, self.units, self.wire = comm, list(units), wire
        self.tier = tier or ParamTier(Tier(), 0)
        self.hpz = SecondaryPartition(comm, secondary) if secondary else None
        self.prefetching = prefetch and not self.tier.moves
        wire.attach(self.units, itemsize)
        self._wire_in_tier()

    def _wire_in_tier(self) -> None:
        """FP8 gather with shards in a tier: each wire packs at its gather, from amaxes
        noted while the shard is in memory — here, read once from the tier."""
        if not self.tier.moves:
            return
        for u in self.units:
            if u.wire is not None and u.index in self.tier.placed:
                u.wire.lazy = True
                self.tier.ready(u)
                u.wire.note(u.shard)
                self.tier.release(u)

    # ------------------------------------------------------------ a unit's gather
    def _start(self, u: ShardedUnit, forward: bool, async_op: bool) -> None:
        """For the backward from hpZ's node-local copy when there is one, otherwise
        across every rank through the wire."""
        via = self.hpz.via(u) if self.hpz is not None and not forward else None
        u.unshard(u.part.comm, async_op=async_op, via=via)

    def prefetch(self, u: ShardedUnit | None, forward: bool = True) -> None:
        if u is not None and self.prefetching:
            self._start(u, forward, async_op=True)

    def gather(self, u: ShardedUnit, forward: bool, neighbour: Neighbour) -> None:
        """Gather `u` now (its shard made ready from the tier first, released after),
        then start what comes next: the tier's reads `offload_prefetch` units ahead,
        else the next unit's gather."""
        self.tier.ready(u)
        if u.wire is not None:
            u.wire.ready(u.shard)
        self._start(u, forward, async_op=False)
        u.wait_unshard()
        self.tier.release(u)
        nxt = neighbour(u, forward)
        ahead = nxt
        for _ in range(self.tier.depth):
            if ahead is None:
                break
            self.tier.fetch(ahead)
            ahead = neighbour(ahead, forward)
        self.prefetch(nxt, forward)

    def release(self, u: ShardedUnit, after_forward: bool = False) -> None:
        """`u` has run: free its full buffer (after its forward, hpZ keeps its slice)."""
        if after_forward and self.hpz is not None:
            self.hpz.keep(u)
        u.reshard()

    def reduced(self, u: ShardedUnit) -> None:
        """`u`'s gradients are reduced: neither its buffer nor hpZ's copy is needed."""
        u.reshard()
        if self.hpz is not None:
            self.hpz.drop(u)

    def end_backward(self) -> None:
        if self.hpz is not None:
            self.hpz.clear()
        for u in self.units:
            u.reshard()
            u.gathered_for_backward = False

    # ------------------------------------------------------------ new values
    def publish(self, u: ShardedUnit, write: Callable[[ShardedUnit, Tensor], None],
                enqueue: Callable[[Handle], None]) -> None:
        """`write(u, shard)` puts the new master into the shard (fresh memory when the
        shard lives in a tier); the wire notes it; a persistent unit is re-gathered."""
        self.tier.overwrite(u)
        write(u, u.shard)
        if u.wire is not None:
            u.wire.note(u.shard)
        self.tier.written(u)
        if u.persistent:
            enqueue(u.part.comm.all_gather(u.params, u.shard, async_op=True))

    def refresh(self) -> None:
        """Every unit published: the wire re-packs (`PlainWire.refresh`), the tier's
        write-behind lands."""
        self.wire.refresh(self.units, self.comm)
        self.tier.settle_all()

    @contextmanager
    def full(self, units: Sequence[ShardedUnit]) -> Iterator[None]:
        """`units` gathered exactly (the parameter dtype's values, never the wire's)."""
        for u in units:
            self.tier.ready(u)
            u.unshard(u.part.comm, async_op=False, exact=True)
            self.tier.release(u)
        try:
            yield
        finally:
            for u in units:
                u.reshard()

    # ------------------------------------------------------------ what it holds
    def moving_tiers(self) -> list[Tier]:
        return [self.tier.tier] if self.tier.moves else []

    def resident_bytes(self) -> int:
        """Between uses: the shards in memory (not those in a moving tier) and hpZ's
        copies kept from the forward for the backward."""
        own = sum(_nbytes(u.shard) for u in self.units)
        return own + (self.hpz.resident_bytes() if self.hpz is not None else 0)

    def landing_bytes(self) -> int:
        """Full buffers gathered right now (persistent units' included)."""
        return sum(_nbytes(u.params) for u in self.units)

    def gathered_bytes(self) -> int:
        """Full buffers of non-persistent units gathered right now."""
        return sum(u.gathered_bytes() for u in self.units)


def _nbytes(t: Any) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0
