"""How a run ends when the world intervenes: preemption, a dead launcher, injected faults.

- `Preemption`: SIGTERM (what schedulers send before a preemption) and Ctrl-C set a flag;
  the loop agrees on it across ranks at the next step boundary, saves a checkpoint and
  exits with `EXIT_INTERRUPTED`, without tracebacks. A second one aborts at once, even
  inside a step that never ends (a watcher thread hears it, not the busy main thread).
- `die_with_parent()`: a rank started by a launcher dies with it (Linux `prctl`), so a
  `kill -9` of the launcher never leaves ranks training on their own.
- `maybe_inject_fault()`: `train.fault.{rank,step}` kills that rank at that step (first
  attempt only), to test and demonstrate `--max-restarts`.
- `disk_full_error()`: a full disk at a save is one line naming the folder, the bytes
  wanted and free, and the checkpoint that is still intact (not a SafetensorError).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.io import latest_name
from zerotrain.comm.launch import EXIT_INTERRUPTED
from zerotrain.config import FaultConfig  # EX_TEMPFAIL: try again later
from zerotrain.zero.tiers.lazy import Lazy

_PR_SET_PDEATHSIG = 1
__all__ = ["EXIT_INTERRUPTED", "Interrupted", "Preemption", "die_with_parent",
           "disk_full", "disk_full_error", "maybe_inject_fault", "restart_count",
           "tensor_bytes"]


class Interrupted(Exception):
    """Raised once the interrupted run has saved; the CLI turns it into one line."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"interrupted at step {step}; checkpoint saved ({checkpoint}); "
                         "resume with --resume")
        self.step = step


class Preemption:
    """SIGTERM/SIGINT handlers that only raise a flag (no exception mid-step); the second
    signal exits at once without saving.

    Python runs signal handlers in the main thread between bytecodes, so a step stuck in
    one long native call would hear nothing. The C-level handler also writes each
    signal's number to a wakeup socket (`signal.set_wakeup_fd`); a daemon thread reading
    it counts the signals the moment they arrive.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool | None = None) -> None:
        self.requested = False
        self.count = 0
        # who says "press Ctrl-C again": rank 0 of a job without our launcher (under
        # `--nproc`, the launcher hears the Ctrl-C and says it)
        self.announce = announce if announce is not None else (
            int(os.environ.get("RANK", "0")) == 0
            and not os.environ.get("ZEROTRAIN_LAUNCHER_PID"))
        self._old: dict[int, object] = {}
        self._old_fd: int | None = None
        self._socks: tuple[socket.socket, socket.socket] | None = None
        self._lock = threading.Lock()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # counting is the watcher's (it hears each signal once)
        if self._socks is None:  # no watcher: count here
            self._heard(signum)

    def _heard(self, signum: int) -> None:
        with self._lock:
            self.count += 1
            self.requested = True
            count = self.count
        tty = "\n" if sys.stderr.isatty() else ""  # off a progress bar's line
        if count == 1:
            if signum == signal.SIGINT and self.announce:
                print(f"{tty}zerotrain: stopping after this step to save a checkpoint; press "
                      "Ctrl-C again to abort without saving", file=sys.stderr, flush=True)
            return
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"{tty}zerotrain: aborted by a second {what} without saving; --resume "
              "continues from the last complete checkpoint", file=sys.stderr, flush=True)
        if self._socks is None:  # the main thread's handler (a notebook): raise there
            raise KeyboardInterrupt
        os._exit(128 + signum)

    def _watch(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self._heard(signum)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals belong to the main thread: leave them alone
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._handler)
        if "ipykernel" in sys.modules or hasattr(sys, "ps1"):
            return self  # interactive: a second Ctrl-C interrupts, never ends the kernel
        try:
            r, w = socket.socketpair()
            w.setblocking(False)
            self._old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except (OSError, ValueError):
            return self  # no wakeup fd: the main-thread handler counts
        self._socks = (r, w)
        threading.Thread(target=self._watch, args=(r,), name="zerotrain-signals",
                         daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._socks is not None:
            signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
            self._socks[1].close()  # the watcher's recv ends
            self._socks[0].shutdown(socket.SHUT_RDWR)
            self._socks[0].close()
            self._socks = None
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies."""
    parent = int(os.environ.get("ZEROTRAIN_LAUNCHER_PID", "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to ask
        return
    if parent and os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def maybe_inject_fault(fault: FaultConfig, rank: int, step: int) -> None:
    """SIGKILL this rank if `train.fault` names it and this step (first attempt only)."""
    if fault.step == step and fault.rank == rank and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job's ranks."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def disk_full(e: BaseException) -> bool:
    """Is this a full disk or an exhausted quota (as OSError, or safetensors' own error)?"""
    import errno

    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        s in str(e) for s in ("No space left on device", "Disk quota exceeded"))


def tensor_bytes(x: Any) -> int:
    """Bytes of every tensor in a nested state dict (tier states as `Lazy`: counted from
    their shape, never read)."""
    if isinstance(x, torch.Tensor | Lazy):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    return sum(tensor_bytes(v) for v in x) if isinstance(x, (list, tuple)) else 0


def disk_full_error(e: BaseException, root: Path, step: int, wanted: int) -> CheckpointError:
    """One line for a save that found the disk full: where, how much, what is still safe
    (`latest` moves only after a complete save, so it names an intact checkpoint)."""
    import shutil

    try:
        free = f"{shutil.disk_usage(root).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    name = latest_name(root)
    kept = (f"the last complete checkpoint, {name}, is intact" if name
            else "no earlier checkpoint exists")
    what = "disk quota exceeded" if "quota" in str(e).lower() else "no space left on device"
    return CheckpointError(
        f"{what} while saving the step-{step} checkpoint in '{root}' (this rank writes "
        f"about {wanted:,} bytes; {free}); {kept}. Free some space or set checkpoint.dir "
        "to another disk, then continue with --resume")
