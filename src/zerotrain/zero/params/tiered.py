"""ZeRO-3's parameter shards in a tier between uses (`zero.offload_param`), read by the
parameter store (zero/params/store.py).

Before a unit's gather its shard is made ready (the load was started
`zero.offload_prefetch` units earlier, so it ran while those units computed), the
gather reads it, and the shard's memory is released at once — it is clean, the tier
holds the same bytes. After the optimizer step the new shard is written whole into
fresh memory (no read) and written back behind the next units' updates. Persistent
units (under `zero.param_persistence_threshold`) keep their shard: it is a view of
their gathered buffer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from zerotrain.zero.tiers.placed import Placed
from zerotrain.zero.tiers.tier import Tier


class ParamTier:
    """Where ZeRO-3's parameter shards live between uses (the module docstring)."""

    def __init__(self, tier: Tier, depth: int):
        self.tier, self.depth = tier, depth
        self.placed: dict[int, Placed] = {}
        self.writing: list[Placed] = []  # shards written back, oldest first
        # (unit index, IOHandle) since the last step (bounded: evaluation has no step)
        self.loads: deque[tuple[int, Any]] = deque(maxlen=4096)

    @property
    def moves(self) -> bool:
        return self.tier.moves

    def place(self, u: Any) -> None:
        """A unit just built: its shard to the tier (so at most one unit's shard is ever
        in memory at init)."""
        if self.tier.moves and not u.persistent:
            p = self.placed[u.index] = Placed(self.tier, f"unit{u.index}.shard", u.shard)
            p.evict()
            p.settle()

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
        if p is not None:
            p.settle()
            p.claim()

    def written(self, u: Any) -> None:
        """The publish wrote the shard: send it back (write behind; a shard's memory is
        released once `depth` (at least one) newer writes have started)."""
        p = self.placed.get(u.index)
        if p is not None:
            p.evict()
            self.writing.append(p)
            while len(self.writing) > max(1, self.depth):
                self.writing.pop(0).settle()

    def settle_all(self) -> None:
        for p in self.writing:
            p.settle()
        self.writing.clear()
        self.loads.clear()
