"""The offload tiers (zero/tiers/tier.py, zero/tiers/io.py): bytes in and out bit-exact, aligned
blocks, counters, the run's own directory and its removal, and the errors of a bad or
full disk."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from zerotrain.zero.tiers import io as tier_io
from zerotrain.zero.tiers.io import PREFIX, TierError, aligned
from zerotrain.zero.tiers.placed import Placed
from zerotrain.zero.tiers.tier import HostTier, NvmeTier, make_tier


def nvme(tmp_path, **kw) -> NvmeTier:
    kw.setdefault("block_mb", 4096 / 2**20)  # one page per block: several blocks per region
    return NvmeTier(str(tmp_path), threads=3, **kw)


@pytest.mark.parametrize("direct", [False, "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_round_trip_bit_exact_odd_sizes(tmp_path, direct, dtype):
    t = nvme(tmp_path, direct=direct)
    g = torch.Generator().manual_seed(0)
    sizes = [1, 1023, 4096, 5000, 3 * 4096 // dtype.itemsize + 7]
    src = [(torch.randn(n, generator=g) * 100).to(dtype) for n in sizes]
    regions = [t.region(f"r{i}", n, dtype) for i, n in enumerate(sizes)]
    for r in regions:
        assert r.offset % 4096 == 0
    # every region starts where the previous one's padded size ends
    assert [r.offset for r in regions[1:]] == [
        r.offset + aligned(r.nbytes) for r in regions[:-1]]
    for h in [t.store(r, s) for r, s in zip(regions, src, strict=True)]:
        h.wait()
    out = [torch.zeros(n, dtype=dtype) for n in sizes]
    for h in [t.load(r, o) for r, o in zip(reversed(regions), reversed(out), strict=True)]:
        h.wait()
    for s, o in zip(src, out, strict=True):
        assert torch.equal(s.view(torch.uint8), o.view(torch.uint8))
    nbytes = sum(s.numel() * s.element_size() for s in src)
    assert t.counter.take() == {"read": nbytes, "written": nbytes}
    assert t.counter.take() == {"read": 0, "written": 0}
    assert t.counter.total_read == nbytes
    t.close()


def test_direct_is_used_where_the_filesystem_allows(tmp_path):
    t = nvme(tmp_path, direct="auto")
    assert t.direct == tier_io.supports_direct(str(tmp_path))
    if not t.direct:
        assert any("refuses O_DIRECT" in line for line in t.describe())
    t.close()


def test_blocks_cover_the_region_in_aligned_requests(tmp_path, monkeypatch):
    calls = []

    def spy(fd, data, offset):
        calls.append((offset, len(data)))
        return os.pwrite(fd, data, offset)

    monkeypatch.setattr(tier_io, "pwrite", spy)
    t = nvme(tmp_path, direct=False, block_mb=8192 / 2**20)
    t.region("pad", 10, torch.float32)
    r = t.region("x", 5000, torch.float32)  # 20000 bytes: blocks of 8192, 8192, 3616
    t.store(r, torch.arange(5000, dtype=torch.float32)).wait()
    assert sorted(calls) == [(4096, 8192), (4096 + 8192, 8192), (4096 + 16384, 3616)]
    t.close()


def test_run_directory_is_private_and_removed(tmp_path):
    t = nvme(tmp_path)
    root = t.root
    assert root.parent == tmp_path and root.name.startswith(PREFIX)
    assert "NOT A CHECKPOINT" in (root / "NOT_A_CHECKPOINT").read_text()
    t.region("a", 100, torch.float32)
    t.close()
    assert not root.exists()
    t.close()  # twice is harmless


def test_removed_at_exit_after_an_exception(tmp_path):
    code = ("import torch, sys\nfrom zerotrain.zero.tiers.tier import NvmeTier\n"
            f"t = NvmeTier({str(tmp_path)!r})\nr = t.region('a', 1000, torch.float32)\n"
            "t.store(r, torch.ones(1000)).wait()\nprint(t.root, flush=True)\n"
            "raise SystemExit('boom') if False else ValueError('boom')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "ValueError: boom" in p.stderr
    root = p.stdout.strip()
    assert root.startswith(str(tmp_path)) and not os.path.exists(root)
    assert list(tmp_path.iterdir()) == []


def test_a_dead_runs_directory_is_swept(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    import socket
    host = socket.gethostname().replace("-", "_")
    stale = tmp_path / f"{PREFIX}-{host}-{int(p.stdout)}-r0-deadbeef"
    stale.mkdir()
    (stale / "regions.bin").write_bytes(b"x" * 10)
    t = nvme(tmp_path)
    assert not stale.exists() and t.root.exists()
    t.close()


def test_unwritable_path_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores modes: a path under a regular file
            target = tmp_path / "file"
            target.write_text("")
            bad = str(target / "sub")
        else:
            bad = str(ro)
        with pytest.raises(TierError, match=f"zero.nvme_path {bad}: cannot create"):
            NvmeTier(bad)
    finally:
        ro.chmod(0o700)


def test_free_space_checked_before_start(tmp_path):
    t = nvme(tmp_path)
    free = tier_io.free_bytes(str(tmp_path))
    t.require(1024)
    with pytest.raises(TierError) as e:
        t.require(free + 2**40)
    msg = str(e.value)
    assert str(tmp_path) in msg and str(free + 2**40) in msg and "larger disk" in msg
    t.close()


def test_free_space_counts_the_machines_ranks(tmp_path, monkeypatch):
    """Ranks on one machine share the disk: each checks room for all of them."""
    t = nvme(tmp_path)
    third = tier_io.free_bytes(str(tmp_path)) // 3
    t.require(third)  # one rank: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(TierError, match="this machine's 4 ranks' offload files need "
                                        f"{4 * third} bytes"):
        t.require(third)
    t.close()


def test_full_disk_mid_run_is_one_error_naming_path_and_bytes(tmp_path, monkeypatch):
    t = nvme(tmp_path, direct=False)
    r = t.region("unit3.master", 10000, torch.float32)
    t.store(r, torch.ones(10000)).wait()

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tier_io, "pwrite", full)
    h = t.store(r, torch.zeros(10000))  # ten blocks, all failing
    with pytest.raises(TierError) as e:
        h.wait()
    msg = str(e.value)
    assert msg.count("No space left on device") == 1
    assert f"zero.nvme_path {tmp_path}" in msg and "writing unit3.master (40000 bytes)" in msg
    assert f"need {aligned(40000)} bytes" in msg and "Checkpoints" in msg
    with pytest.raises(TierError) as again:  # the tier refuses further moves, same error
        t.load(r, torch.zeros(10000))
    assert again.value is e.value
    t.close()


def test_io_error_on_read(tmp_path, monkeypatch):
    t = nvme(tmp_path, direct=False)
    r = t.region("u", 100, torch.float32)
    monkeypatch.setattr(tier_io.os, "preadv",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(TierError, match=r"reading u .* Input/output error.*check the disk"):
        t.load(r, torch.zeros(100)).wait()
    t.close()


def test_handles_time_and_overlap(tmp_path, monkeypatch):
    """Two regions on three threads are in flight at once; a handle ends when its last
    block lands (the blocks are held at a gate the test opens)."""
    gate = threading.Event()
    real = os.pwrite

    def gated(fd, data, offset):
        assert gate.wait(30)
        return real(fd, data, offset)

    monkeypatch.setattr(tier_io, "pwrite", gated)
    t = nvme(tmp_path, direct=False)
    a, b = t.region("a", 1024, torch.float32), t.region("b", 1024, torch.float32)
    ha = t.store(a, torch.ones(1024))
    hb = t.store(b, torch.ones(1024))
    assert not ha.done() and ha.end is None and not hb.done()
    opened = time.perf_counter()
    gate.set()
    ha.wait()
    hb.wait()
    assert ha.end is not None and hb.end is not None
    assert ha.start < hb.start < opened < min(ha.end, hb.end)  # both in flight together
    assert t.counter.take() == {"read": 0, "written": 2 * 4096}
    t.close()


def test_placed_moves_storage_in_place(tmp_path):
    t = nvme(tmp_path, direct="auto")
    x = torch.arange(3000, dtype=torch.float32)
    view = x[100:200]  # an optimizer's view of a master
    p = Placed(t, "m", x)
    p.evict()
    p.settle()
    assert x.untyped_storage().nbytes() == 0 and not p.resident
    p.fetch()
    assert p.ready() is x
    assert torch.equal(view, torch.arange(100, 200, dtype=torch.float32))
    view.add_(1)  # changed in place: written at the next eviction
    p.dirty = True
    p.evict()
    p.settle()
    assert t.counter.take() == {"read": 12000, "written": 24000}
    p.ready()
    assert float(x[150]) == 151.0
    p.evict()  # clean: released without a write
    p.settle()
    assert t.counter.take() == {"read": 12000, "written": 0}
    t.close()


def test_logical_host_tier_on_cpu():
    t = make_tier("cpu", torch.device("cpu"))
    assert isinstance(t, HostTier) and not t.moves
    x = torch.ones(10)
    p = Placed(t, "s", x)
    p.evict()
    p.settle()
    assert x.untyped_storage().nbytes() == 40 and p.ready() is x
    assert t.counter.take() == {"read": 0, "written": 0}
