"""Where a flat tensor lives between its uses: an offload tier (ZeRO-Infinity).

A `Tier` stores regions — flat runs of one dtype, each with a fixed home — and moves
them in and out asynchronously; every move is an `IOHandle` (zero/tiers/io.py) with its
start and end, and its bytes go to the tier's `IOCounter`, read per step like the
collectives' traffic.

- `HostTier` (`cpu`): regions in host memory, pinned at their exact size when they feed
  a GPU, moved by copies on a side stream fenced by events. On a CPU-only machine host
  and device are one memory: the tier is logical (`moves` False) and nothing is copied,
  as with ZeRO-Offload.
- `NvmeTier` (`nvme`): regions in one file of the run's own directory under
  `zero.nvme_path`, made with a name no checkpoint reader looks at
  (`.zerotrain-swap-*`, with a NOT_A_CHECKPOINT note), its space allocated up front
  after a free-space check, and removed at close, at interpreter exit (also after an
  exception) and by the next run on the host if a killed run left it.

`Placed` (zero/tiers/placed.py) is one tensor that lives in a tier.
"""

from __future__ import annotations

import contextlib
import errno
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from zerotrain.memory.host import host_buffer, release_host_buffer
from zerotrain.zero.tiers.io import (
    BlockIO,
    IOCounter,
    IOHandle,
    TierError,
    aligned,
    byte_view,
    free_bytes,
    held_by_others,
    make_run_dir,
    remove_run_dir,
    supports_direct,
)


@dataclass(eq=False)
class Region:
    key: str
    numel: int
    dtype: torch.dtype
    offset: int = 0              # NVMe: where it starts in the tier's file (4 KiB aligned)
    host: Tensor | None = None   # host tier: where it lives

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Tier:
    """The interface; `kind` names it in configs and logs."""

    kind = "none"
    moves = False  # False: the tensor stays where it is (a logical tier)

    def __init__(self) -> None:
        self.counter = IOCounter()

    def require(self, nbytes: int) -> None:
        """Before start: refuse a tier that cannot hold `nbytes` (one error)."""

    def region(self, key: str, numel: int, dtype: torch.dtype) -> Region:
        return Region(key, numel, dtype)

    def store(self, r: Region, src: Tensor) -> IOHandle:
        return IOHandle(f"store {r.key}", 0)

    def load(self, r: Region, dst: Tensor) -> IOHandle:
        return IOHandle(f"load {r.key}", 0)

    def describe(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class HostTier(Tier):
    """Host memory; a real move only when the device is not the host."""

    kind = "cpu"

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.moves = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.moves else None
        self.pinned: list[Tensor] = []

    def region(self, key: str, numel: int, dtype: torch.dtype) -> Region:
        r = Region(key, numel, dtype)
        if self.moves:  # pinned at its exact size (torch's pinned allocator rounds up)
            r.host = host_buffer(numel, dtype, True)
            self.pinned.append(r.host)
        return r

    def _copy(self, what: str, dst: Tensor, src: Tensor, nbytes: int,
              read: bool) -> IOHandle:
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.counter.add(read=nbytes if read else 0, written=0 if read else nbytes)
        return EventHandle(what, nbytes, event, keep=(dst, src))

    def store(self, r: Region, src: Tensor) -> IOHandle:
        if not self.moves:
            return super().store(r, src)
        assert r.host is not None
        return self._copy(f"store {r.key}", r.host, src, r.nbytes, read=False)

    def load(self, r: Region, dst: Tensor) -> IOHandle:
        if not self.moves:
            return super().load(r, dst)
        assert r.host is not None
        return self._copy(f"load {r.key}", dst, r.host, r.nbytes, read=True)

    def close(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).synchronize()
            self.stream.synchronize()
        for t in self.pinned:
            release_host_buffer(t)
        self.pinned.clear()


class EventHandle(IOHandle):
    """A copy on a side stream: `wait` makes the current stream wait for it (no host
    stall) and keeps both tensors alive until then."""

    def __init__(self, what: str, nbytes: int, event, keep):
        super().__init__(what, nbytes, keep=keep)
        self.event = event
        self.end = None

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)
        self.end = self.end or self.start
        self._keep = None

    def synchronize(self) -> None:
        self.event.synchronize()


class NvmeTier(Tier):
    kind = "nvme"
    moves = True

    def __init__(self, path: str, *, threads: int = 4, block_mb: float = 1.0,
                 direct: bool | str = "auto", rank: int = 0):
        super().__init__()
        self.path = path
        self.root = make_run_dir(path, rank)
        ok = supports_direct(str(self.root))
        if direct is True and not ok:
            remove_run_dir(self.root)
            raise TierError(f"zero.nvme_direct: true, but {path} refuses O_DIRECT (a tmpfs or "
                            "network filesystem?): set zero.nvme_direct: auto or false")
        self.direct = bool(direct) and ok
        self.fallback = direct == "auto" and not ok
        self.file = self.root / "regions.bin"
        flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
        self.fd = os.open(self.file, flags, 0o600)
        self.io = BlockIO(threads, int(block_mb * 2**20), self.direct)
        self.size = 0  # bytes allocated in the file
        self.failed: TierError | None = None
        self._finalizer = weakref.finalize(self, _close, self.io, self.fd, self.root)

    # ------------------------------------------------------------ before start
    def require(self, nbytes: int) -> None:
        """Refuse a disk without room for this rank's files and those of the other ranks
        on this machine (torchrun's LOCAL_WORLD_SIZE; they share `nvme_path`, each about
        as large; what they allocated already counts as theirs). The files are allocated
        (fallocate) as the units are cut: a disk filling meanwhile fails before step 1."""
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        total = nbytes * ranks
        free = free_bytes(self.path) + held_by_others(Path(self.path), self.root)
        if free < total:
            who = f"this machine's {ranks} ranks' offload files" if ranks > 1 else \
                "the offload files"
            raise TierError(
                f"zero.nvme_path {self.path}: {who} need {total} bytes "
                f"({total / 2**30:.2f} GiB) and only {free} bytes ({free / 2**30:.2f} GiB) "
                "are free there: free space, or point zero.nvme_path at a larger disk")

    def region(self, key: str, numel: int, dtype: torch.dtype) -> Region:
        r = Region(key, numel, dtype, offset=self.size)
        n = aligned(r.nbytes)
        try:  # really allocated: a full disk shows here, not in the middle of a step
            os.posix_fallocate(self.fd, r.offset, max(n, 1))
        except OSError as e:
            raise self.error(f"allocating {key}", n, e) from e
        self.size += n
        return r

    # ------------------------------------------------------------ moves
    def store(self, r: Region, src: Tensor) -> IOHandle:
        self._check()
        assert src.numel() == r.numel and src.dtype == r.dtype, (r.key, src.shape, src.dtype)
        futures = self.io.write(self.fd, byte_view(src), self.counter, r.offset)
        return IOHandle(f"store {r.key}", r.nbytes, futures, keep=src,
                        on_error=lambda e: self.error(f"writing {r.key}", r.nbytes, e))

    def load(self, r: Region, dst: Tensor) -> IOHandle:
        self._check()
        assert dst.numel() == r.numel and dst.dtype == r.dtype, (r.key, dst.shape, dst.dtype)
        futures = self.io.read(self.fd, byte_view(dst), self.counter, r.offset)
        return IOHandle(f"load {r.key}", r.nbytes, futures, keep=dst,
                        on_error=lambda e: self.error(f"reading {r.key}", r.nbytes, e))

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def error(self, doing: str, nbytes: int, e: BaseException) -> TierError:
        """One error for a failed move (the first; later moves repeat it), naming the
        path, the bytes the run needs there and what to do."""
        if self.failed is not None:
            return self.failed
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else repr(e)
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        need = max(self.size, nbytes)
        hint = ("free space there, or point zero.nvme_path at a larger disk" if full else
                "check the disk (dmesg), or point zero.nvme_path at another disk")
        self.failed = TierError(
            f"zero.nvme_path {self.path}: {doing} ({nbytes} bytes) failed: {why}; the run's "
            f"offload files need {need} bytes ({need / 2**30:.2f} GiB) there, "
            f"{free_bytes(self.path)} bytes free now: {hint}. Checkpoints are separate "
            "and were not touched: resume from the last one")
        return self.failed

    def describe(self) -> list[str]:
        how = "O_DIRECT" if self.direct else "buffered"
        lines = [f"nvme tier: {self.root} ({how}, {self.io.pool._max_workers} threads, "
                 f"{self.io.block // 1024} KiB blocks)"]
        if self.fallback:
            lines.append(f"nvme tier: {self.path} refuses O_DIRECT; using buffered I/O "
                         "(the page cache holds recently moved data)")
        return lines

    def close(self) -> None:
        self._finalizer()


def _close(io: BlockIO, fd: int, root: Path) -> None:
    io.close()
    with contextlib.suppress(OSError):
        os.close(fd)
    remove_run_dir(root)


def make_tier(kind: str, device: torch.device, *, path: str | None = None, threads: int = 4,
              block_mb: float = 1.0, direct: bool | str = "auto", rank: int = 0) -> Tier:
    """The tier a config names: none (the device itself), cpu or nvme."""
    if kind == "cpu":
        return HostTier(device)
    if kind == "nvme":
        assert path, "zero.nvme_path is checked by the config"
        return NvmeTier(path, threads=threads, block_mb=block_mb, direct=direct, rank=rank)
    return Tier()
