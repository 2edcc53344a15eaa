"""ZeRO-Offload — over ZeRO-2 or ZeRO-3: the optimizer's world moves to host memory.

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

import torch
from torch import Tensor

from zerotrain.zero.flat import Segment
from zerotrain.zero.grads import ShardedGrads
from zerotrain.zero.unit import Unit
from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3


def host_buffer(numel: int, dtype: torch.dtype, pinned: bool) -> Tensor:
    """Zeros in host memory; pinned at exactly this size when it feeds a GPU."""
    t = torch.zeros(numel, dtype=dtype)
    if pinned and t.numel():
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({err}) for {t.numel()} elements")
    return t


def release_host_buffer(t: Tensor) -> None:
    if t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostGrads(ShardedGrads):
    """ZeRO-2's gradients with the shard in host memory (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpu = self.device.type == "cuda" and self.host.type == "cpu"
        self.stream = torch.cuda.Stream(self.device) if self.gpu else None
        self.pending: list[tuple[Unit, torch.cuda.Event, bool]] = []
        self.registered: list[Tensor] = []

    def allocate(self, u: Unit) -> None:
        if not self.gpu:  # a CPU rank: the plain (uninitialised) host shard
            super().allocate(u)
            return
        u.grad = host_buffer(u.shard_numel, self.dtype, True)
        self.registered.append(u.grad)

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
                    u.staging = host_buffer(u.shard_numel, self.dtype, True)
                    self.registered.append(u.staging)
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

    def close(self) -> None:
        for t in self.registered:
            release_host_buffer(t)
        self.registered.clear()


class OffloadMixin:
    """What Offload adds to a stage: host gradients, and an async, fenced publish.

    On a GPU the optimizer steps unit by unit (`Strategy.step_by_unit`): each unit's
    host-to-device publish is queued as soon as the CPU has updated it and runs while the
    CPU updates the next one. A unit's copy reads its master (or its host-cast staging)
    asynchronously, so the next update of that unit first waits for that copy's event.
    """

    offload = True
    grads_class = HostGrads

    def write_master_into(self, u: Unit, dst: Tensor) -> None:
        if not self.grads.gpu:
            super().write_master_into(u, dst)
            return
        src = u.master
        if dst.dtype != src.dtype:  # cast on the host: half the bytes cross the bus
            if u.publish_staging is None:
                u.publish_staging = host_buffer(src.numel(), dst.dtype, True)
                self.grads.registered.append(u.publish_staging)
            u.publish_staging.copy_(src)
            src = u.publish_staging
        dst.copy_(src, non_blocking=True)
        u.published = torch.cuda.Event()
        u.published.record(torch.cuda.current_stream(self.device))

    def host_zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        if not self.grads.gpu:
            return super().host_zeros(numel, dtype)
        t = host_buffer(numel, dtype, True)
        self.grads.registered.append(t)
        return t

    def attach_grads(self, segments: list[tuple[Segment, Tensor]] | None = None) -> None:
        """Before the CPU writes these units' masters: their last publish has read them."""
        for i in {seg.unit for seg, _ in (self.opt_segments if segments is None else segments)}:
            u = self.units[i]
            if u.published is not None:
                u.published.synchronize()
                u.published = None
        super().attach_grads(segments)

    def close(self) -> None:
        self.grads.close()
        super().close()


class ZeRO2Offload(OffloadMixin, ZeRO2):
    name = "zero2-offload"


class ZeRO3Offload(OffloadMixin, ZeRO3):
    name = "zero3-offload"
