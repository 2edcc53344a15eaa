"""ZeRO-Offload — a placement (zero/states/home.py) for ZeRO-2 or ZeRO-3: the optimizer's world
moves to host memory.

The gradient shard, the FP32 master shard and the optimizer states live in host memory;
the host CPU runs the update — memory-bound, few flops per byte, a good fit for the CPU —
and only the half-precision parameter shard goes back to the device. Per step: gradients
go down once, parameters come up once.

On a GPU the copies must not stall the device or race the CPU:
- host buffers are pinned at their exact size (`host_buffer`: torch's pinned allocator
  would round every request up to a power of two);
- each reduced gradient shard crosses into pinned memory asynchronously on a side stream
  while backward goes on; the CPU adds a micro-step's contribution once its copy has
  landed (`HostGrads.drain`, at the end of backward, one unit after another, so adding
  one overlaps the next one's copy);
- the new weights go up cast on the host (2 bytes per parameter cross the bus in bf16),
  asynchronously, and the next CPU update waits for that copy first (an event), so it
  never overwrites a master that is still being read.
On a CPU-only machine host and device are the same memory: the split is logical (and
still shown by the audit) and none of the machinery runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotrain.memory.host import (  # noqa: F401 (here before memory/host.py had them)
    _REGISTERED,
    clear_cuda_error,
    host_buffer,
    release_host_buffer,
)
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.states.grads import FullGrads, ShardedGrads
from zerotrain.zero.states.home import Placement
from zerotrain.zero.unit import Unit


class HostGrads(ShardedGrads):
    """ZeRO-2's gradients with the shard in host memory (see the module docstring); its
    pinned buffers are made and released by the `HostOffload` placement."""

    def __init__(self, *args, placement: HostOffload, **kwargs):
        super().__init__(*args, **kwargs)
        self.placement = placement
        self.gpu = placement.gpu
        self.stream = torch.cuda.Stream(self.device) if self.gpu else None
        self.pending: list[tuple[Unit, torch.cuda.Event, bool]] = []

    def allocate(self, u: Unit) -> None:
        if not self.gpu:  # a CPU rank: the plain (uninitialised) host shard
            super().allocate(u)
            return
        u.grad = self.placement.pinned(u.shard_numel, self.dtype)

    def landing(self, u: Unit):
        if not self.gpu:
            return super().landing(u)
        bucket = self.target(u)
        out = torch.empty(u.shard_numel, dtype=bucket.dtype, device=self.device)
        first = not u.grad_dirty
        u.grad_dirty = True

        def done() -> None:  # the reduce-scatter has completed on the current stream
            if first:
                dst = u.grad
            else:
                if u.staging is None:
                    u.staging = self.placement.pinned(u.shard_numel, self.dtype)
                dst = u.staging
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(out, non_blocking=True)
                out.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.pending.append((u, event, first))
            self.release(u)
        return out, done

    def drain(self) -> None:
        for u, event, first in self.pending:
            event.synchronize()
            if not first:
                assert u.staging is not None
                u.grad.add_(u.staging)
        self.pending.clear()


class HostOffload(Placement):
    """ZeRO-Offload's placement: gradient shard, masters and optimizer states in host
    memory (pinned when they feed a GPU), and an async, fenced publish.

    On a GPU the optimizer steps unit by unit (`zero.update.UnitByUnit`): each unit's
    host-to-device publish is queued as soon as the CPU has updated it and runs while the
    CPU updates the next one. A unit's copy reads its master (or its host-cast staging)
    asynchronously, so the next update of that unit first waits for that copy's event.
    """

    suffix = "-offload"
    offloads = frozenset({"grads", "master", "optimizer"})

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.host = torch.device("cpu")
        self.gpu = device.type == "cuda"
        self.steps_by_unit = self.gpu
        self.registered: list[Tensor] = []  # pinned buffers, unregistered at `close`

    def pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = host_buffer(numel, dtype, True)
        self.registered.append(t)
        return t

    def make_grads(self, stage: Any, policy: PrecisionPolicy, in_flight: int) -> FullGrads:
        if not stage.grads_class.sharded:
            raise ValueError(f"{stage.name} keeps full gradients; Offload needs them sharded")
        self.grads = HostGrads(policy.grad_dtype, self.device, self.host, placement=self,
                               **stage.grads_options(policy, in_flight))
        return self.grads

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.pinned(numel, dtype) if self.gpu else super().zeros(numel, dtype)

    def write_master(self, u: Unit, dst: Tensor) -> None:
        if not self.gpu:
            super().write_master(u, dst)
            return
        src = u.master
        if dst.dtype != src.dtype:  # cast on the host: half the bytes cross the bus
            if u.publish_staging is None:
                u.publish_staging = self.pinned(src.numel(), dst.dtype)
            self.fence(u)  # the last publish's copy may still read the staging
            u.publish_staging.copy_(src)
            src = u.publish_staging
        dst.copy_(src, non_blocking=True)
        u.published = torch.cuda.Event()
        u.published.record(torch.cuda.current_stream(self.device))

    def fence(self, u: Unit) -> None:
        if u.published is not None:
            u.published.synchronize()
            u.published = None

    def close(self) -> None:
        """Unregister the pinned buffers, once every copy into or out of them is done
        (a publish H2D on the compute stream, a gradient D2H on the side stream)."""
        if self.gpu and self.registered:
            torch.cuda.current_stream(self.device).synchronize()
            stream = getattr(self.grads, "stream", None)
            if stream is not None:
                stream.synchronize()
        for t in self.registered:
            release_host_buffer(t)
        self.registered.clear()
