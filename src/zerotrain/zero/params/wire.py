"""How ZeRO-3's parameters travel when a unit is gathered: one part, chosen once.

`PlainWire`: the parameter dtype as it is. `Fp8Gather`: the plan's FP8-linear weights as
one byte per element (zero/params/fp8_wire.py), re-packed after every update. `choose_wire` is
where the config picks one (`zero.build_strategy` and `zero.run_shape` only call it):
another wire (int8 with per-block scales, ZeRO++'s qwZ) is one more class with these
methods — `element_bytes` is its memory term — and one more line there, all in this file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zerotrain.comm.collectives import Comm
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.wire_quant import BLOCK
from zerotrain.zero.params.fp8_wire import Fp8Wire, refresh_all
from zerotrain.zero.params.int8_wire import Int8Wire
from zerotrain.zero.unit import ShardedUnit


class PlainWire:
    name = "plain"

    def element_bytes(self, name: str, param_bytes: int) -> float:
        """Bytes parameter `name` sends per element (a fraction where scales ride along):
        the wire's memory term, read by `zero.run_shape` into `RunShape.gather_bytes`."""
        return param_bytes

    def unit_bytes(self, named: Sequence[tuple[str, torch.Tensor, int]], numel: int,
                   param_bytes: int) -> int:
        """A unit spanning `numel` elements, as this wire sends it: each parameter at its
        `element_bytes`, alignment padding raw (each rank's chunk padding to the longest
        rank's, under one element per piece, is not counted)."""
        params = sum(p.numel() for _, p, _ in named)
        return math.ceil(sum(p.numel() * self.element_bytes(n, param_bytes)
                             for n, p, _ in named) + (numel - params) * param_bytes)

    def attach(self, units: Sequence[ShardedUnit], itemsize: int) -> None:
        """Give the units that gather through this wire their `u.wire`."""

    def refresh(self, units: Sequence[ShardedUnit], comm: Comm) -> None:
        """After an update: re-pack what the next gathers send."""


@dataclass(frozen=True)
class Fp8Gather(PlainWire):
    fp8_weights: frozenset[str]  # parameter names of the plan's FP8 linears' weights
    name = "fp8"

    def element_bytes(self, name: str, param_bytes: int) -> float:
        return 1 if name in self.fp8_weights else param_bytes

    def attach(self, units: Sequence[ShardedUnit], itemsize: int) -> None:
        for u in units:
            if not u.persistent and any(s.name in self.fp8_weights for s in u.slots):
                u.wire = Fp8Wire(u, set(self.fp8_weights), itemsize)

    def refresh(self, units: Sequence[ShardedUnit], comm: Comm) -> None:
        with torch.no_grad():
            refresh_all(list(units), comm)


@dataclass(frozen=True)
class Int8Gather(PlainWire):
    """ZeRO++'s qwZ (`zero.param_wire: int8`): every parameter as int8 codes with one
    fp32 scale per block of 256 (zero/params/int8_wire.py)."""

    name = "int8"

    def element_bytes(self, name: str, param_bytes: int) -> float:
        return 1 + 4 / BLOCK

    def attach(self, units: Sequence[ShardedUnit], itemsize: int) -> None:
        for u in units:
            if not u.persistent:
                u.wire = Int8Wire(u)

    def refresh(self, units: Sequence[ShardedUnit], comm: Comm) -> None:
        with torch.no_grad():
            for u in units:
                if u.wire is not None and not u.wire.lazy:
                    u.wire.pack(u.shard)


def choose_wire(shards: frozenset[str], plan: Plan, cfg: ZeroConfig, *,
                fp8_gather: bool = False) -> PlainWire:
    """The wire of a strategy sharding `shards`: only ZeRO-3 gathers parameters, so any
    other stage travels plain. `zero.param_wire` fp8 (alias: precision.fp8.all_gather,
    `fp8_gather`): the plan's FP8 linears' weights go as one byte per element; int8
    (qwZ): every parameter block-quantised. A new wire adds its line here."""
    if "params" not in shards:
        return PlainWire()
    if fp8_gather or cfg.param_wire == "fp8":
        return Fp8Gather(frozenset(f"{m}.weight" for m in plan.fp8_linears))
    if cfg.param_wire == "int8":
        return Int8Gather()
    return PlainWire()
