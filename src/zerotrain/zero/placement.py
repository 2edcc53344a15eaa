"""Where the optimizer's side of the model states lives: one part of a strategy, chosen once.

A `Placement` answers, for a built strategy, where the gradient shard, the master weights
and the optimizer states live (`host`, `offloads`), how their buffers are made
(`make_grads`, `zeros`), how new weights get from the master into the parameters
(`write_master`), what must be waited for before the CPU writes a master again (`fence`),
and what to release at the end (`close`). The Strategy calls only these; it never asks
which placement it holds.

- `OnDevice` (this module): everything beside the parameters, on the compute device.
- `HostOffload` (zero/offload.py, ZeRO-Offload): gradient shard, masters and optimizer
  states in (pinned) host memory, the CPU updates, publishes are asynchronous and fenced.

Where another tier plugs in (ZeRO-Infinity, issue 25): a tier is one more `Placement`
subclass with these methods (an NVMe optimizer tier: `zeros` maps its buffers, `fence`
waits for a swap-in, `write_master`/`close` as here), made by `choose_placement` in
zero/__init__.py from the config; `offloads` names the states it moves off the device so
the memory model reads it (`memory.RunShape.offloads`). Parameter shards are ZeRO-3's own
(`ShardedUnit.shard`); a parameter tier (`zero.offload_param`) is a second part handed to
ZeRO-3 beside this one, not a method here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.grads import FullGrads
from zerotrain.zero.unit import Unit


class Placement:
    """Where the gradient shard, masters and optimizer states live (base: the device)."""

    suffix = ""  # appended to the stage's name (`zero2` + `-offload`): checkpoints record it
    offloads: frozenset[str] = frozenset()  # model states kept off the device (memory.FIELDS)
    steps_by_unit = False  # whether an elementwise update steps and publishes unit by unit

    def __init__(self, device: torch.device):
        self.device = device
        self.host = device  # where the gradient shard, masters and optimizer states live
        self.grads: FullGrads | None = None

    def make_grads(self, stage: Any, policy: PrecisionPolicy, in_flight: int) -> FullGrads:
        """The gradient store of `stage` (a Strategy class) placed here."""
        self.grads = stage.grads_class(policy.grad_dtype, self.device, self.host,
                                       **stage.grads_options(policy, in_flight))
        return self.grads

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A zeroed buffer for master weights (or anything the optimizer's side keeps)."""
        return torch.zeros(numel, dtype=dtype, device=self.host)

    def write_master(self, u: Unit, dst: Tensor) -> None:
        """Copy `u.master` into `dst` (this rank's parameters) — a no-op when the
        parameters are their own master."""
        if u.master.data_ptr() != dst.data_ptr():
            dst.copy_(u.master, non_blocking=True)

    def fence(self, u: Unit) -> None:
        """Before the host writes `u.master` (or what its publish reads): wait for the
        last asynchronous publish of `u` to have read it."""

    def close(self) -> None:
        """Release what lives outside torch's allocators, once nothing uses it."""


class OnDevice(Placement):
    """No offload: every model state on the compute device."""


@dataclass(frozen=True)
class Kind:
    """What a strategy is before it is built: its stage class and its placement class.
    Read by `run_shape` (shards, offloads, cut) and by checkpoints (name)."""

    stage_class: Any  # a zero.base.Strategy subclass (base imports this module)
    placement: type[Placement]

    @property
    def name(self) -> str:
        return self.stage_class.name + self.placement.suffix

    @property
    def stage(self) -> int:
        return self.stage_class.stage

    @property
    def shards(self) -> frozenset[str]:
        return self.stage_class.shards

    @property
    def offloads(self) -> frozenset[str]:
        return self.placement.offloads

    def cut(self, *args) -> list:
        return self.stage_class.cut(*args)
