"""A unit's runtime state, owned by the unit: its tensors and where it is in a step.

`Unit` is a `FlatUnit` layout plus the tensors living in its coordinates — the full
parameter buffer every parameter is a view of, the master copy the optimizer updates,
the gradient the optimizer reads — and the bookkeeping of one backward (which
parameters' gradients arrived, whether the reduction started).

`ShardedUnit` (ZeRO-3) adds the parameter shard and an explicit life cycle with the
verbs FSDP2 uses: SHARDED —unshard→ GATHERING —wait_unshard→ GATHERED —reshard→
SHARDED. "Sharded" releases the full buffer's storage (`resize_(0)`) while every
parameter view stays valid, so autograd's saved references see the re-gathered values.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.zero.flat import FlatUnit


@dataclass(eq=False)
class Unit(FlatUnit):
    params: Tensor = field(default=None, repr=False)   # type: ignore[assignment]
    master: Tensor = field(default=None, repr=False)   # type: ignore[assignment]
    grad: Tensor = field(default=None, repr=False)     # type: ignore[assignment]
    bucket: Tensor | None = field(default=None, repr=False)  # ZeRO-2+: transient, full size
    module: nn.Module | None = field(default=None, repr=False)  # ZeRO-3: whose hooks drive it
    grad_dirty: bool = False     # the persistent gradient holds a contribution already
    staging: Tensor | None = field(default=None, repr=False)  # Offload: pinned landing
    publish_staging: Tensor | None = field(default=None, repr=False)  # Offload: host cast
    published: Any = field(default=None, repr=False)  # Offload on CUDA: publish copy's event
    ready: set[int] = field(default_factory=set)      # slots whose gradient arrived
    reduced: bool = False        # this backward's reduction has been started

    def materialize(self, dtype: torch.dtype, device: torch.device,
                    init: Callable[[Unit], None] | None = None) -> Tensor:
        """Give the unit its flat buffer and make each parameter a view of it.

        Parameters that hold values are copied in; parameters on the meta device (a
        model built without memory) get their values from `init(unit)` once the views
        exist — written in place, so the buffer is the only copy ever made.
        """
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        meta = [s for s in self.slots if s.param.device.type == "meta"]
        with torch.no_grad():
            for s in self.slots:
                if s.param.device.type != "meta":
                    flat[s.offset:s.end].copy_(s.param.detach().reshape(-1))
        self.params = flat
        self.point_params_at(flat)
        if meta and init is not None:
            init(self)
        return flat

    def point_params_at(self, flat: Tensor) -> None:
        # `.data =` keeps each Parameter object (hooks, tied modules, user references) and
        # its own autograd version counter, so refilling `flat` in place never trips
        # autograd's saved-tensor checks. A meta parameter cannot take real data that way:
        # its tensor is swapped in place instead, which keeps the object just the same.
        for s in self.slots:
            if s.param.device.type == "meta":
                empty = torch.empty(0, dtype=flat.dtype, device=flat.device)
                torch.utils.swap_tensors(s.param, nn.Parameter(empty, s.param.requires_grad))
            s.param.data = flat[s.offset:s.end].view(s.shape)

    def install_grads(self, buf: Tensor) -> None:
        """Let autograd accumulate straight into `buf` (dtypes allowing) for slots whose
        gradient has not arrived yet."""
        if buf.dtype != self.params.dtype:
            return
        for i, s in enumerate(self.slots):
            if i not in self.ready and s.param.grad is None:
                s.param.grad = self.view_of(buf, s)

    def end_backward(self) -> None:
        self.ready.clear()
        self.reduced = False


class UnitState(enum.Enum):
    SHARDED = "sharded"        # only this rank's shard exists; the full buffer is empty
    GATHERING = "gathering"    # an all-gather into the full buffer is in flight
    GATHERED = "gathered"      # every parameter is usable


@dataclass(eq=False)
class ShardedUnit(Unit):
    shard: Tensor = field(default=None, repr=False)    # type: ignore[assignment]
    persistent: bool = False   # small units stay gathered between uses
    state: UnitState = UnitState.GATHERED
    handle: Handle | None = field(default=None, repr=False)
    gathered_for_backward: bool = False
    wire: Any = field(default=None, repr=False)  # zero.fp8_wire.Fp8Wire: gather in FP8
    _wire: Any = field(default=None, repr=False)  # the wire of the gather in flight

    def unshard(self, comm: Comm, async_op: bool = True, exact: bool = False,
                via: tuple[Comm, Tensor] | None = None) -> None:
        """Start gathering the full parameters (a no-op unless SHARDED). `exact`: the
        parameter dtype's own values even when forward gathers in FP8 (`wire`). `via`:
        gather from another partition instead — (its group, this rank's piece), hpZ's
        node-local copy — as it is, plain."""
        if self.state is not UnitState.SHARDED:
            return
        wire = None if exact or via is not None else self.wire
        st = self.params.untyped_storage()
        st.resize_(self.padded_numel * self.params.element_size())
        self.point_params_at(self.params)
        self._wire = wire
        if via is not None:
            self.handle = via[0].all_gather(self.params, via[1], async_op=async_op)
        else:
            self.handle = (wire.start(comm, async_op) if wire is not None
                           else comm.all_gather(self.params, self.shard, async_op=async_op))
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            assert self.handle is not None
            self.handle.wait()
            self.handle = None
            if self._wire is not None:
                self._wire.unpack(self.params)
            self.state = UnitState.GATHERED

    def reshard(self) -> None:
        """Release the full buffer (waiting for a gather still in flight into it).

        The parameters then point at a one-element NaN tensor expanded to their shape:
        reading a sharded parameter outside the hooks gives visible NaNs of the right
        shape instead of touching freed memory (a crash on CPU, an illegal memory access
        that poisons the context on CUDA). Autograd's saved views keep the full buffer's
        storage and see it refilled by the next gather; `unshard` points the parameters
        back at it.
        """
        if self.persistent or self.state is UnitState.SHARDED:
            return
        self.wait_unshard()
        self.params.untyped_storage().resize_(0)
        nan = nan_fill(self.params.dtype, self.params.device)
        for s in self.slots:
            s.param.data = nan.expand(s.shape)
        self.state = UnitState.SHARDED

    def gathered_bytes(self) -> int:
        return 0 if self.persistent else self.params.untyped_storage().nbytes()


_NAN: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def nan_fill(dtype: torch.dtype, device: torch.device) -> Tensor:
    """One shared 1-element NaN per (dtype, device) for resharded parameters to point at
    (expanded, so never written): no allocation and fill kernel per unit per reshard."""
    key = (dtype, device)
    if key not in _NAN:
        _NAN[key] = torch.full((1,), float("nan"), dtype=dtype, device=device)
    return _NAN[key]
