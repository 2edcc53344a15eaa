"""How ZeRO-3's parameters travel when a unit is gathered: one part, chosen once.

`PlainWire`: the parameter dtype as it is. `Fp8Gather`: the plan's FP8-linear weights as
one byte per element (zero/fp8_wire.py), re-packed after every update. `choose_wire` is
where the config picks one (`zero.build_strategy` only calls it): another wire (int8
with per-block scales, ZeRO++'s qwZ) is one more class with these two methods and one
more line there, both in this file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zerotrain.comm.collectives import Comm
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.zero.fp8_wire import Fp8Wire, refresh_all
from zerotrain.zero.unit import ShardedUnit


class PlainWire:
    name = "plain"

    def attach(self, units: Sequence[ShardedUnit], itemsize: int) -> None:
        """Give the units that gather through this wire their `u.wire`."""

    def refresh(self, units: Sequence[ShardedUnit], comm: Comm) -> None:
        """After an update: re-pack what the next gathers send."""


@dataclass(frozen=True)
class Fp8Gather(PlainWire):
    fp8_weights: frozenset[str]  # parameter names of the plan's FP8 linears' weights
    name = "fp8"

    def attach(self, units: Sequence[ShardedUnit], itemsize: int) -> None:
        for u in units:
            if not u.persistent and any(s.name in self.fp8_weights for s in u.slots):
                u.wire = Fp8Wire(u, set(self.fp8_weights), itemsize)

    def refresh(self, units: Sequence[ShardedUnit], comm: Comm) -> None:
        with torch.no_grad():
            refresh_all(list(units), comm)


def choose_wire(shards: frozenset[str], plan: Plan, cfg: ZeroConfig, *,
                fp8_gather: bool = False) -> PlainWire:
    """The wire of a strategy sharding `shards`: only ZeRO-3 gathers parameters, so any
    other stage travels plain. `fp8_gather` (precision.fp8.all_gather): the plan's FP8
    linears' weights go as one byte per element. A new wire adds its line here, read
    from its `zero.*` field of `cfg`."""
    if "params" not in shards:
        return PlainWire()
    if fp8_gather:
        return Fp8Gather(frozenset(f"{m}.weight" for m in plan.fp8_linears))
    return PlainWire()
