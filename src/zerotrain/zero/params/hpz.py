"""ZeRO++'s hpZ: a second, node-local partition of the parameters kept between a unit's
forward and its backward.

ZeRO-3 gathers each unit twice per step, for the forward and again for the backward,
both across every rank. With `zero.secondary_partition: K`, right after a unit's
forward each rank keeps its slice (1/K) of the gathered unit, over a group of K
consecutive ranks (a node, or part of one); the backward's gather then runs inside
that group only, from those slices. The values are the forward's own, so training is
bit for bit ZeRO-3's (with qwZ, the decoded values the forward saw). Cost: 1/K of every
non-persistent unit, held from its forward until its gradients are reduced
(`resident_bytes`, what the memory model adds).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm
from zerotrain.config import ConfigError
from zerotrain.config.nodes import secondary_partition_problem
from zerotrain.zero.unit import ShardedUnit


class SecondaryPartition:
    def __init__(self, comm: Comm, k: int):
        """Collective: every rank builds it (it makes the groups of K ranks)."""
        problem = secondary_partition_problem(k, comm.node_size, comm.world_size)
        if problem:
            raise ConfigError(problem)
        self.k = k
        self.group = comm.split(k)
        self.copies: dict[int, Tensor] = {}

    def keep(self, u: ShardedUnit) -> None:
        """After `u`'s forward, while it is gathered: keep this rank's 1/K of it (only
        when a backward will follow)."""
        if u.persistent or not torch.is_grad_enabled():
            return
        n = u.padded_numel // self.k
        r = self.group.rank
        self.copies[u.index] = u.params[r * n:(r + 1) * n].clone()

    def via(self, u: ShardedUnit) -> tuple[Comm, Tensor] | None:
        """Where `u`'s backward gather comes from: this group and this rank's slice."""
        part = self.copies.get(u.index)
        return None if part is None else (self.group, part)

    def drop(self, u: ShardedUnit) -> None:
        self.copies.pop(u.index, None)

    def clear(self) -> None:
        self.copies.clear()

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())
