"""Flat buffers and their partition across ranks — the data structure under every stage.

A `FlatUnit` is a group of parameters laid end to end in one contiguous buffer, padded
to a multiple of the world size N so it splits into N equal shards; rank r owns
elements [r·S, (r+1)·S). Stages 0–2 use units as communication buckets; ZeRO-3 uses
them as the gather/free granularity (one transformer block each). Inside a unit the
parameters are ordered by optimizer group, so any shard meets each group in at most
one contiguous segment: a ZeRO shard is just a few slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter
    offset: int          # start in the unit's flat buffer
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


@dataclass
class FlatUnit:
    index: int
    name: str
    slots: list[ParamSlot]
    world_size: int
    rank: int
    numel: int = 0
    padded_numel: int = 0
    shard_numel: int = 0
    flat: Tensor | None = None       # full parameters (param dtype); may be freed in ZeRO-3
    modules: list[nn.Module] = field(default_factory=list)

    @classmethod
    def build(cls, index: int, name: str, named: list[tuple[str, nn.Parameter, int]],
              world_size: int, rank: int) -> FlatUnit:
        named = sorted(named, key=lambda t: t[2])  # stable: group order, then model order
        slots, off = [], 0
        for pname, p, group in named:
            slots.append(ParamSlot(pname, p, off, p.numel(), p.shape, group))
            off += p.numel()
        padded = -(-off // world_size) * world_size if off else world_size
        return cls(index, name, slots, world_size, rank, off, padded, padded // world_size)

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

    # ---------------------------------------------------------------- parameter views
    def materialize(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Copy the parameters into a fresh flat buffer and make each one a view of it."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for s in self.slots:
                flat[s.offset:s.end].copy_(s.param.detach().reshape(-1))
        self.flat = flat
        self.point_params_at(flat)
        return flat

    def point_params_at(self, flat: Tensor) -> None:
        # `.data =` keeps each Parameter object (hooks, tied modules, user references) and
        # its own autograd version counter, so refilling `flat` in place never trips
        # autograd's saved-tensor checks.
        for s in self.slots:
            s.param.data = flat[s.offset:s.end].view(s.shape)

    def view_of(self, buf: Tensor, slot: ParamSlot) -> Tensor:
        return buf[slot.offset:slot.end].view(slot.shape)

    # ZeRO-3: release / restore the full buffer's memory while every view stays valid.
    def is_allocated(self) -> bool:
        assert self.flat is not None
        return self.flat.untyped_storage().size() > 0

    def free(self) -> None:
        assert self.flat is not None
        self.flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        assert self.flat is not None
        st = self.flat.untyped_storage()
        nbytes = self.padded_numel * self.flat.element_size()
        if st.size() != nbytes:
            st.resize_(nbytes)

    def layout(self) -> dict:
        """Plain-JSON description, enough to consolidate shards without the model."""
        return {
            "name": self.name, "numel": self.numel, "padded_numel": self.padded_numel,
            "params": [[s.name, list(s.shape), s.offset, s.group] for s in self.slots],
        }


def bucket_params(named: list[tuple[str, nn.Parameter, int]], bucket_numel: int
                  ) -> list[list[tuple[str, nn.Parameter, int]]]:
    """Cut parameters into buckets in reverse registration order (≈ the order their
    gradients become ready in backward), each at most `bucket_numel` unless one
    parameter alone is larger."""
    buckets: list[list[tuple[str, nn.Parameter, int]]] = [[]]
    size = 0
    for item in reversed(named):
        n = item[1].numel()
        if buckets[-1] and size + n > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return [b for b in buckets if b]
