"""How ZeRO-3's parameters travel when a unit is gathered: one part, chosen once.

`PlainWire`: the parameter dtype as it is. `Fp8Gather`: the plan's FP8-linear weights as
one byte per element (zero/fp8_wire.py), re-packed after every update. Another wire
(int8 with per-block scales, ZeRO++'s qwZ) is one more class with these two methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zerotrain.comm.collectives import Comm
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
