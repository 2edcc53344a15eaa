"""Block I/O for the NVMe tier: aligned requests from a thread pool, counted, timed.

A region's transfer is cut into blocks of `zero.nvme_block_mb` (a multiple of 4 KiB)
and each block is one `pread`/`pwrite` on a pool thread (they release the GIL, so the
threads really run together and beside the training thread). With `O_DIRECT` the
kernel needs the buffer, the offset and the length aligned: each thread then goes
through its own page-aligned bounce buffer (an anonymous `mmap`), the last block padded
with zeros to 4 KiB — the files are allocated at padded sizes. Buffered I/O reads and
writes the tensor's own bytes.

`IOHandle` is one transfer in flight: its block futures and when it started and ended
(`time.perf_counter`), so a timeline can be asserted; `wait()` raises one `TierError`
naming the path and the bytes needed, whatever number of blocks failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

ALIGN = 4096
pwrite = os.pwrite  # module-level, so a test can make the disk full
PREFIX = ".zerotrain-swap"
NOTE = ("Offload files of a running zerotrain process (zero.offload_param / "
        "zero.offload_optimizer nvme). NOT A CHECKPOINT: removed when the run exits.\n")




def aligned(n: int) -> int:
    """`n` rounded up to the 4 KiB an O_DIRECT request needs."""
    return -(-n // ALIGN) * ALIGN


def byte_view(t: Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (any dtype: bf16 has no
    buffer protocol of its own). The caller keeps `t` alive while the view is used."""
    assert t.device.type == "cpu" and t.is_contiguous(), "block I/O reads host memory"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class TierError(RuntimeError):
    """An offload tier cannot hold the run's data (disk full, I/O error, bad path)."""


@dataclass
class IOCounter:
    """Bytes read from and written to a tier since the last `take()` (a step), and in
    total; thread-safe (pool threads add as blocks complete)."""

    read: int = 0
    written: int = 0
    total_read: int = 0
    total_written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read: int = 0, written: int = 0) -> None:
        with self.lock:
            self.read += read
            self.written += written
            self.total_read += read
            self.total_written += written

    def take(self) -> dict[str, int]:
        """This step's bytes {"read", "written"}, and start the next step at zero."""
        with self.lock:
            out = {"read": self.read, "written": self.written}
            self.read = self.written = 0
        return out


class IOHandle:
    """One region's transfer: `start`/`end` (perf_counter seconds; `end` None while in
    flight), `wait()` for it, `done()` to ask."""

    def __init__(self, what: str, nbytes: int, futures: list[Future] | None = None,
                 keep: Any = None, on_error: Callable[[BaseException], TierError] | None = None):
        self.what, self.nbytes = what, nbytes
        self.start = time.perf_counter()
        self.end: float | None = None
        self._futures = futures or []
        self._keep = keep  # the tensor the blocks read or write: alive until done
        self._on_error = on_error
        self._left = len(self._futures)
        self._lock = threading.Lock()
        if not self._futures:
            self.end = self.start
        for f in self._futures:
            f.add_done_callback(self._finished)

    def _finished(self, _f: Future) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.end = time.perf_counter()

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        first: BaseException | None = None
        for f in self._futures:
            e = f.exception()
            if e is not None and first is None:
                first = e
        self._futures, self._keep = [], None
        if first is not None:
            if isinstance(first, TierError) or self._on_error is None:
                raise first
            raise self._on_error(first) from first


class BlockIO:
    """The pool that moves blocks between host memory and files (one per tier)."""

    def __init__(self, threads: int, block_bytes: int, direct: bool):
        self.block = max(ALIGN, aligned(block_bytes))
        self.direct = direct
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zerotrain-nvme")
        self._local = threading.local()

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:  # page-aligned: what O_DIRECT needs of the memory
            buf = self._local.buf = mmap.mmap(-1, self.block)
        return buf

    def blocks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.block, nbytes)) for a in range(0, nbytes, self.block)]

    def write(self, fd: int, data: memoryview, counter: IOCounter,
              offset: int) -> list[Future]:
        """Write `data` at `offset` (4 KiB aligned) of `fd`, one future per block."""
        return [self.pool.submit(self._write_block, fd, data, a, b, counter, offset)
                for a, b in self.blocks(len(data))]

    def read(self, fd: int, out: memoryview, counter: IOCounter,
             offset: int) -> list[Future]:
        """Fill `out` from `offset` (4 KiB aligned) of `fd`, one future per block."""
        return [self.pool.submit(self._read_block, fd, out, a, b, counter, offset)
                for a, b in self.blocks(len(out))]

    def _write_block(self, fd: int, data: memoryview, a: int, b: int,
                     counter: IOCounter, offset: int) -> None:
        src = data[a:b]
        if self.direct:
            buf = self._bounce()
            n = aligned(b - a)
            mv = memoryview(buf)
            mv[:b - a] = src
            mv[b - a:n] = bytes(n - (b - a))
            src = mv[:n]
        done = 0
        while done < len(src):
            k = pwrite(fd, src[done:], offset + a + done)
            if k <= 0:
                raise OSError(errno.EIO, "short write")
            done += k
        counter.add(written=b - a)

    def _read_block(self, fd: int, out: memoryview, a: int, b: int,
                    counter: IOCounter, offset: int) -> None:
        dst = out[a:b]
        if self.direct:
            n = aligned(b - a)
            mv = memoryview(self._bounce())[:n]
            _read_full(fd, mv, offset + a)
            dst[:] = mv[:b - a]
        else:
            _read_full(fd, dst, offset + a)
        counter.add(read=b - a)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _read_full(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        k = os.preadv(fd, [dst[done:]], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, f"short read at byte {offset + done}")
        done += k


def supports_direct(directory: str) -> bool:
    """Whether files in `directory` take O_DIRECT (tmpfs, some overlay and network
    filesystems refuse it): one aligned 4 KiB write to a probe file."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = os.path.join(directory, "direct-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.pwrite(fd, memoryview(buf), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def held_by_others(base: Path, own: Path) -> int:
    """Bytes already allocated under `base` by the other live swap directories of this
    host (the other ranks of this run, which may have allocated before this one checks)."""
    host = socket.gethostname().replace("-", "_")
    total = 0
    for d in base.glob(f"{PREFIX}-{host}-*"):
        if d != own:
            for f in d.iterdir():
                with contextlib.suppress(OSError):
                    total += f.stat().st_blocks * 512
    return total


def make_run_dir(path: str, rank: int) -> Path:
    """This process's own directory under `path` (made if missing), after removing any a
    dead process on this host left; an unwritable path is refused here, before start."""
    base = Path(path)
    try:
        base.mkdir(parents=True, exist_ok=True)
        sweep_stale(base)
        host = socket.gethostname().replace("-", "_")
        root = base / f"{PREFIX}-{host}-{os.getpid()}-r{rank}-{uuid.uuid4().hex[:8]}"
        root.mkdir()
        (root / "NOT_A_CHECKPOINT").write_text(NOTE)
    except OSError as e:
        raise TierError(f"zero.nvme_path {path}: cannot create the run's offload files there "
                        f"({e.strerror or e}): give a writable directory on a local disk"
                        ) from e
    return root


def remove_run_dir(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def sweep_stale(base: Path) -> None:
    """Remove swap directories of processes on this host that no longer run."""
    host = socket.gethostname().replace("-", "_")
    for d in base.glob(f"{PREFIX}-{host}-*"):
        try:
            pid = int(d.name.split("-")[3])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            remove_run_dir(d)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
