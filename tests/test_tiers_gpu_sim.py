"""The offload tiers' GPU branches (zero/tiers/tier.py), on the CPU (issue 25 item 6).

Device tensors are the stand-in accelerator's (`simdevice.py`: labelled `meta`, CPU data
underneath, refusing every op that mixes them with CPU tensors, as CUDA does). The CUDA
runtime calls the branches make — side streams, events, cudaHostRegister, pinned
allocations — are replaced by fakes that record them in one log, so the tests assert
where each copy is issued and which fence comes before which use.

A released storage (`untyped_storage().resize_(0)`) only shrinks the stand-in's label,
not its CPU data: the tests poison that data once it is released, so a round trip holds
only if the tier really brought the bytes back.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simdevice import SIM, SimDevice, SimTensor
from zerotrain.zero.states import host as offload
from zerotrain.zero.tiers.placed import Placed
from zerotrain.zero.tiers.tier import EventHandle, HostTier, NvmeTier

CUDA = torch.device("cuda", 0)


class _Runtime:
    """Fake torch.cuda streams, events and host registration, logging every call; the
    copies' log lines name the stream current when they were issued."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute = self.Stream(self, "compute")
        self.current = self.compute
        self.registered: list[tuple[int, int]] = []
        self.pinned: list[tuple[str, int]] = []
        self.events = 0  # events made so far: each one's number

    class Stream:
        def __init__(self, rt: _Runtime, name: str = "side"):
            self.rt, self.name = rt, name

        def wait_stream(self, other) -> None:
            self.rt.log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event) -> None:
            self.rt.log.append(("wait_event", self.name, event.n))

        def synchronize(self) -> None:
            self.rt.log.append(("sync_stream", self.name))

    def install(self, mp: pytest.MonkeyPatch) -> None:
        rt = self

        class Event:
            def __init__(self):
                self.n, self.stream = rt.events, None
                rt.events += 1

            def record(self, stream=None) -> None:
                self.stream = stream
                rt.log.append(("record", stream.name, self.n))

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                rt.log.append(("sync_event", self.n))

        @contextlib.contextmanager
        def stream(s):
            before, rt.current = rt.current, s
            try:
                yield
            finally:
                rt.current = before

        class Cudart:
            def cudaHostRegister(self, ptr, nbytes, flags):
                rt.registered.append((ptr, nbytes))
                return 0

            def cudaHostUnregister(self, ptr):
                return 0

        empty = torch.empty

        def pinned_empty(*args, pin_memory=False, **kw):
            t = empty(*args, **kw)
            if pin_memory:
                rt.pinned.append(("empty", t.numel()))
            return t

        def pin_memory(t):
            assert t.device.type == "cpu", "only host memory is pinned"
            rt.pinned.append(("pin_memory", t.numel()))
            return t.clone()

        mp.setattr(torch.cuda, "Stream", lambda device=None: self.Stream(rt))
        mp.setattr(torch.cuda, "stream", stream)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: rt.compute)
        mp.setattr(torch.cuda, "Event", Event)
        mp.setattr(torch.cuda, "cudart", lambda: Cudart())
        mp.setattr(torch, "empty", pinned_empty)
        mp.setattr(torch.Tensor, "pin_memory", pin_memory)


class _Copies(TorchDispatchMode):
    """Logs each copy_ (destination device <- source device) with the issuing stream."""

    def __init__(self, rt: _Runtime):
        super().__init__()
        self.rt = rt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.rt.log.append(("copy", self.rt.current.name,
                                f"{dst.device.type}<-{src.device.type}"))
        return func(*args, **kwargs)


def _device_tensor(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A device tensor (owning its storage) and its CPU reference values."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g, dtype=torch.float32).to(torch.bfloat16)
    return ref.to("meta"), ref.clone()


def _poison(t: torch.Tensor) -> None:
    """What a released device storage holds: nothing usable."""
    assert isinstance(t, SimTensor) and t.untyped_storage().nbytes() == 0
    t.inner.fill_(float("nan"))


def _after(log: list, i: int) -> list:
    out = log[i:]
    del log[:]
    return out


def test_host_tier_moves_a_device_tensor_on_a_side_stream_fenced_by_events(monkeypatch):
    """(a) store/load of a device tensor: a pinned region of exactly its size, the copy
    issued on the side stream after it waited for the compute stream, an event recorded
    there, and `wait` makes the compute stream wait that event (no host stall)."""
    rt = _Runtime()
    rt.install(monkeypatch)
    with SimDevice(), _Copies(rt):
        tier = HostTier(CUDA)
        assert tier.moves and tier.stream is not None and tier.stream.name == "side"
        src, ref = _device_tensor(1000, 0)
        r = tier.region("w", 1000, torch.bfloat16)
        assert r.host.device.type == "cpu" and r.host.numel() == 1000
        assert rt.registered == [(r.host.data_ptr(), 2000)]  # pinned, exact size
        assert offload._REGISTERED.get(r.host.data_ptr()) is not None
        h = tier.store(r, src)
        assert isinstance(h, EventHandle)
        assert _after(rt.log, 0) == [("wait_stream", "side", "compute"),
                                     ("copy", "side", "cpu<-meta"), ("record", "side", 0)]
        assert torch.equal(r.host.view(torch.int16), ref.view(torch.int16))
        h.wait()
        assert rt.log == [("wait_event", "compute", 0)]
        dst = torch.zeros(1000, dtype=torch.bfloat16, device=SIM)
        rt.log.clear()
        h = tier.load(r, dst)
        assert _after(rt.log, 0) == [("wait_stream", "side", "compute"),
                                     ("copy", "side", "meta<-cpu"), ("record", "side", 1)]
        h.wait()
        assert rt.log == [("wait_event", "compute", 1)]
        assert torch.equal(dst.cpu().view(torch.int16), ref.view(torch.int16))  # bit-exact
        assert tier.counter.read == 2000 and tier.counter.written == 2000
        rt.log.clear()
        tier.close()
        assert rt.log == [("sync_stream", "compute"), ("sync_stream", "side")]
        assert offload._REGISTERED.get(r.host.data_ptr()) is None  # unregistered


def test_a_placed_device_tensor_round_trips_and_a_rewrite_waits_for_the_store(monkeypatch):
    """(c) Placed on the device through the host tier: evict → settle releases the device
    memory after the compute stream waited the store's event (no host wait: S-3);
    ready() refills it bit-exactly after the load's event fenced the compute stream; a
    rewrite (claim) while a store is in flight waits that store's event before the tensor
    is handed out for writing."""
    rt = _Runtime()
    rt.install(monkeypatch)
    with SimDevice(), _Copies(rt):
        tier = HostTier(CUDA)
        t, ref = _device_tensor(513, 1)
        p = Placed(tier, "unit0.shard", t)
        p.evict()
        p.settle()
        log = _after(rt.log, 0)
        assert log == [("wait_stream", "side", "compute"), ("copy", "side", "cpu<-meta"),
                       ("record", "side", 0), ("wait_event", "compute", 0)]
        assert not p.resident
        _poison(t)
        assert p.ready() is t and p.resident and not p.dirty
        assert _after(rt.log, 0) == [("wait_stream", "side", "compute"),
                                     ("copy", "side", "meta<-cpu"), ("record", "side", 1),
                                     ("wait_event", "compute", 1)]
        assert torch.equal(t.cpu().view(torch.int16), ref.view(torch.int16))

        # a second write while the first store is in flight
        with torch.no_grad():
            t.add_(1.0)
        ref2 = t.cpu().clone()
        p.dirty = True
        p.evict()  # store of ref2 in flight (event 2)
        p.evict()  # a second evict while it is in flight starts nothing
        assert [x[0] for x in _after(rt.log, 0)] == ["wait_stream", "copy", "record"]
        assert p.claim() is t and p.dirty and p.storing is None
        assert _after(rt.log, 0) == [("wait_event", "compute", 2)]  # fenced before the rewrite
        with torch.no_grad():
            t.mul_(2.0)
        ref3 = t.cpu().clone()
        p.evict()
        p.settle()
        assert [x[0] for x in _after(rt.log, 0)] == [
            "wait_stream", "copy", "record", "wait_event"]
        _poison(t)
        p.ready()
        assert torch.equal(t.cpu().view(torch.int16), ref3.view(torch.int16))
        assert not torch.equal(ref2, ref3)

        # a fetch while an eviction is in flight cancels it: the store's event is waited,
        # nothing is loaded and the memory (still holding the values) stays
        rt.log.clear()
        p.dirty = True
        p.evict()
        p.fetch()
        assert [x[0] for x in _after(rt.log, 0)] == ["wait_stream", "copy", "record",
                                                     "wait_event"]
        assert p.resident and p.storing is None and t.untyped_storage().nbytes() == 1026
        assert torch.equal(t.cpu().view(torch.int16), ref3.view(torch.int16))
        tier.close()


def test_nvme_tier_stages_a_device_tensor_through_pinned_host_memory(monkeypatch, tmp_path):
    """(b) NVMe from a device: the write reads a pinned host copy, the read lands in a
    pinned host buffer then crosses to the device; no block I/O touches device memory
    (byte_view refuses it) and the round trip is bit-exact. The pinned buffer is one
    exact-size registration made once and reused (L-1: not torch's rounding, caching
    pinned allocator; S-2: one device-to-host copy, not a copy and then a pinned copy),
    and the next read into it waits until the copy out of it to the device has run."""
    rt = _Runtime()
    rt.install(monkeypatch)
    tier = NvmeTier(str(tmp_path), threads=2, block_mb=0.004)
    try:
        with SimDevice(), _Copies(rt):
            t, ref = _device_tensor(3000, 2)  # 6000 bytes: two 4 KiB blocks
            p = Placed(tier, "unit0.shard", t)
            assert p._host_side()
            p.evict()
            assert rt.pinned == [] and [n for _, n in rt.registered] == [6000]
            assert _after(rt.log, 0) == [("copy", "compute", "cpu<-meta")]  # one copy
            assert p._staged is not None and p._staged.device.type == "cpu"
            p.settle()
            assert not p.resident and p._staged is None
            assert tier.counter.written >= 6000
            _poison(t)
            p.fetch()
            assert rt.pinned == [] and len(rt.registered) == 1  # the same buffer again
            assert p._staged is not None and p._staged.device.type == "cpu"
            assert p.ready() is t and p._staged is None
            h2d = _after(rt.log, 0)
            assert h2d[0] == ("copy", "compute", "meta<-cpu") and h2d[1][0] == "record"
            assert torch.equal(t.cpu().view(torch.int16), ref.view(torch.int16))
            assert tier.counter.read >= 6000
            p.dirty = False
            p.evict()  # clean: released without a write
            p.fetch()  # the read into the buffer waits for the copy out of it first
            assert rt.log[0] == ("sync_event", h2d[1][2]) and len(rt.registered) == 1
            p.ready()
            assert torch.equal(t.cpu().view(torch.int16), ref.view(torch.int16))
    finally:
        tier.close()


def test_param_tier_on_a_device_reads_fenced_and_writes_behind(monkeypatch):
    """infinity.ParamTier over the host tier with device shards: place releases each
    shard once its store landed; a gather's read is fenced by the load's event; release
    after the gather copies nothing (clean); overwrite hands out memory without a read;
    written shards go back behind the next one (depth 1) and come back bit-exactly."""
    from types import SimpleNamespace

    from zerotrain.zero.params.tiered import ParamTier

    rt = _Runtime()
    rt.install(monkeypatch)
    with SimDevice(), _Copies(rt):
        pt = ParamTier(HostTier(CUDA), depth=1)
        units, refs = [], []
        for i in range(2):
            t, ref = _device_tensor(100 + i, 10 + i)
            units.append(SimpleNamespace(index=i, persistent=False, shard=t))
            refs.append(ref)
            pt.place(units[-1])
            _poison(t)
        rt.log.clear()
        u0 = units[0]
        pt.fetch(u0)
        pt.ready(u0)
        assert [x[0] for x in _after(rt.log, 0)] == ["wait_stream", "copy", "record",
                                                     "wait_event"]
        assert torch.equal(u0.shard.cpu().view(torch.int16), refs[0].view(torch.int16))
        assert len(pt.loads) == 1
        pt.release(u0)
        assert rt.log == [] and u0.shard.untyped_storage().nbytes() == 0  # clean: no copy
        new, stores = [], []
        for u in units:
            rt.log.clear()
            pt.overwrite(u)
            assert rt.log == []  # no read for a whole write
            assert u.shard.untyped_storage().nbytes() == u.shard.numel() * 2
            with torch.no_grad():
                u.shard.copy_(torch.full((u.shard.numel(),), 3.0 + u.index))
            new.append(u.shard.cpu().clone())
            rt.log.clear()
            pt.written(u)
            stores.append(rt.log[2][2])  # the store's event
            assert rt.log[:3] == [("wait_stream", "side", "compute"),
                                  ("copy", "side", "cpu<-meta"), ("record", "side", stores[-1])]
        # unit 0's store was fenced (the compute stream, not the host, waits: S-3), then
        # its memory released, when unit 1's began
        assert rt.log[3:] == [("wait_event", "compute", stores[0])]
        assert not units[0].shard.untyped_storage().nbytes() and pt.writing == [pt.placed[1]]
        assert units[1].shard.untyped_storage().nbytes()  # the newest is still in flight
        pt.settle_all()
        for u, want in zip(units, new):
            assert u.shard.untyped_storage().nbytes() == 0
            _poison(u.shard)
            pt.ready(u)
            assert torch.equal(u.shard.cpu().view(torch.int16), want.view(torch.int16))
        pt.tier.close()
