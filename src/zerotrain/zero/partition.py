"""Who shares a flat buffer: the ranks a unit is cut across, and the Comm that joins them.

A `Partition` is a value chosen once when a strategy is built. Each flat unit
(`zero/flat.py`) holds the one it is cut across and reads only `world` and `rank` from
it; the strategy talks to the other ranks through `comm`. A hierarchical partition
(ZeRO++'s hpZ: parameters sharded within a node, gradients and states across all ranks)
would be a second Partition over a `comm.subgroup(...)`, handed to the parameter store
alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotrain.comm.collectives import Comm


@dataclass(frozen=True)
class Partition:
    world: int
    rank: int
    comm: Comm | None = None  # None: a layout computed without ranks to talk to (tests, tools)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    @classmethod
    def of(cls, comm: Comm) -> Partition:
        """Every rank of `comm`'s group."""
        return cls(comm.world_size, comm.rank, comm)
