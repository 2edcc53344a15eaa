"""The home of the optimizer's side of the model states: gradients, masters, moments.

A `Placement` (a home) answers, for a built strategy, where the gradient shard, the
master weights and the optimizer states live (`host`, `offloads`), how their buffers are
made (`make_grads`, `zeros`), how new weights get from the master into the parameters
(`write_master`), what must be waited for before the CPU writes a master again (`fence`),
and what to release at the end (`close`). A home whose states leave memory between uses
(the disk, zero/states/disk.py) also answers the per-unit residency hooks — `fetch`,
`ready`, `evict`, `settle`, `claim` — and how a checkpoint meets states that are away
(`lazy_states`, `resident`, `fill_optimizer`); here they are no-ops, so the stages and
the updaters call them without asking which home they hold.

- `OnDevice` (this module): everything beside the parameters, on the compute device.
- `HostOffload` (zero/states/host.py, ZeRO-Offload): gradient shard, masters and
  optimizer states in (pinned) host memory, the CPU updates, publishes are asynchronous
  and fenced.
- `NvmeOffload` (zero/states/disk.py, ZeRO-Infinity): ZeRO-Offload's, with masters and
  moments streamed from the disk tier unit by unit.

A new home is one more subclass entered in `PLACEMENTS` (zero/__init__.py) under its
`zero.offload_optimizer` value; `offloads` names the states it moves off the device,
which is what the memory model reads (`Kind.offloads` -> `memory.RunShape.offloads`).
ZeRO-3's parameter shards have their own home, the store (zero/params/store.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.states.grads import FullGrads
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
        self.units: list[Unit] = []
        self.by_unit: dict[int, list[tuple[Any, Tensor]]] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def make(cls, device: torch.device, tiers: Any = None, depth: int = 1) -> Placement:
        """This home for a run on `device`; a home in a tier takes ZeRO-Infinity's
        `tiers` (zero/states/disk.py) and its read-ahead `depth`."""
        return cls(device)

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

    # ------------------------------------------------------------ residency (no-ops here)
    #: units whose states are read ahead of the one updating (a unit-by-unit step)
    depth = 0

    def attach(self, units: Sequence[Unit], views: Sequence[tuple[Any, Tensor]]) -> None:
        """The built strategy's units and the optimizer's views of their masters."""
        self.units, self.by_unit = list(units), {}
        for seg, view in views:
            self.by_unit.setdefault(seg.unit, []).append((seg, view))

    def use(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose states live here (its moments are bound at its step)."""
        self.optimizer = optimizer

    @contextmanager
    def sized(self) -> Iterator[None]:
        """While the optimizer's views are cut: every master has its storage's size."""
        yield

    def fetch(self, u: Unit, grad: bool = False) -> None:
        """Start bringing `u`'s master and moments (and `grad`: its gradient) in."""

    def ready(self, u: Unit, grad: bool = False) -> None:
        """Wait until they are in."""

    def bind(self, u: Unit) -> None:
        """`u`'s moments were (re)made by the optimizer: track them."""

    def claim(self, u: Unit) -> None:
        """`u.master` is about to be written whole: memory for it, no read."""

    def evict(self, u: Unit) -> None:
        """`u` is updated: send its states back (write behind)."""

    def settle(self, u: Unit) -> None:
        """`u`'s states are back: release their memory."""

    def lazy_states(self) -> dict[int, Any]:
        """By id of its tensor: each master or moment away in a tier (`tiers.lazy.Lazy`)."""
        return {}

    def resident(self) -> None:
        """Everything in memory (a load of weights from another source)."""

    def fill_optimizer(self) -> None:
        """After the optimizer's load: moments read from a checkpoint go to their homes."""

    def moving_tiers(self) -> list[Any]:
        """The tiers that really move this home's bytes."""
        return []

    def describe(self) -> str | None:
        """One line for the run's start, or None."""
        return None


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
