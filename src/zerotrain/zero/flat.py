"""Flat layouts and their partition across ranks — the data structure under every stage.

A `FlatUnit` lays a group of parameters end to end in one flat coordinate space, padded
to a multiple of the world size N so it splits into N equal shards; rank r owns
elements [r·S, (r+1)·S). Stages 0–2 use units as communication buckets; ZeRO-3 uses
them as the gather/free granularity (one transformer block each). Inside a unit the
parameters are ordered by optimizer group, so any shard meets each group in at most
one contiguous segment: a ZeRO shard is just a few slices.

This module is layout only (pure arithmetic on shapes); the tensors that live in these
coordinates belong to `zero.unit.Unit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zerotrain.zero.partition import Partition

NamedParams = list[tuple[str, nn.Parameter, int]]  # (name, parameter, optimizer group)


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter
    offset: int          # start in the unit's flat coordinates
    numel: int
    shape: torch.Size
    group: int           # optimizer param-group index

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Segment:
    """A contiguous run [start, end) of the unit's flat coordinates in one param group."""

    unit: int
    group: int
    start: int
    end: int
    param: ParamSlot | None = None  # set when the segment is exactly one whole parameter

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class FlatUnit:
    index: int
    name: str
    slots: list[ParamSlot]
    part: Partition  # the ranks this unit is cut across
    numel: int = 0
    padded_numel: int = 0
    shard_numel: int = 0

    @classmethod
    def build(cls, index: int, name: str, named: NamedParams, part: Partition,
              align: int = 1, **extra) -> FlatUnit:
        """Lay `named` out across `part`'s ranks. `align`: every parameter and every shard
        starts at a multiple of this many elements (GPUs: 16 bytes, so NCCL, foreach
        kernels and cuBLAS take their vectorised paths); 1 packs parameters end to end."""
        named = sorted(named, key=lambda t: t[2])  # stable: group order, then model order
        slots, off = [], 0
        for pname, p, group in named:
            off = -(-off // align) * align
            slots.append(ParamSlot(pname, p, off, p.numel(), p.shape, group))
            off += p.numel()
        step = part.world * align
        padded = -(-off // step) * step if off else step
        return cls(index, name, slots, part, off, padded, padded // part.world, **extra)

    @property
    def world_size(self) -> int:
        return self.part.world

    @property
    def rank(self) -> int:
        return self.part.rank

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def segments(self, lo: int, hi: int, per_param: bool = False) -> list[Segment]:
        """Group-homogeneous pieces of [lo, hi): one per group, or one per parameter."""
        out: list[Segment] = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.end)
            if a >= b:
                continue
            if per_param:
                whole = (a, b) == (s.offset, s.end)
                out.append(Segment(self.index, s.group, a, b, s if whole else None))
            elif out and out[-1].group == s.group and out[-1].end == a:
                out[-1].end = b
            else:
                out.append(Segment(self.index, s.group, a, b))
        return out

    def view_of(self, buf: Tensor, slot: ParamSlot) -> Tensor:
        """`slot`'s parameter-shaped view into a buffer laid out in these coordinates."""
        return buf[slot.offset:slot.end].view(slot.shape)

    def layout(self) -> dict:
        """Plain-JSON description, enough to consolidate shards without the model."""
        return {
            "name": self.name, "numel": self.numel, "padded_numel": self.padded_numel,
            "params": [[s.name, list(s.shape), s.offset, s.group] for s in self.slots],
        }


def flat_end(named: NamedParams, align: int = 1) -> int:
    """Elements a unit of these parameters spans before its padding to N: `FlatUnit.build`'s
    layout (group order, each parameter aligned) without building it."""
    off = 0
    for _, p, _ in sorted(named, key=lambda t: t[2]):
        off = -(-off // align) * align + p.numel()
    return off


def gather_range(unit: dict, lo: int, hi: int, read: Callable[[str, int, int], Tensor],
                 dtype: torch.dtype) -> Tensor:
    """Elements [lo, hi) of a unit's flat coordinates, assembled parameter by parameter.

    `unit` is a `FlatUnit.layout()`; `read(name, start, stop)` returns flat elements of a
    full parameter. Padding stays zero. This is how weights or optimizer state cut one
    way (another world size, stage, or a pretrained file) are cut again for this rank.
    """
    out = torch.zeros(hi - lo, dtype=dtype)
    for name, shape, off, _group in unit["params"]:
        n = math.prod(shape)
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out[a - lo:b - lo] = read(name, a - off, b - off)
    return out
