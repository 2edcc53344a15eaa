"""How a run ends when the world intervenes: preemption, a dead launcher, injected faults.

- `Preemption`: SIGTERM (what schedulers send before a preemption) and Ctrl-C set a flag;
  the loop agrees on it across ranks at the next step boundary, saves a checkpoint and
  exits with `EXIT_INTERRUPTED`, without tracebacks.
- `die_with_parent()`: a rank started by a launcher dies with it (Linux `prctl`), so a
  `kill -9` of the launcher never leaves ranks training on their own.
- `maybe_inject_fault()`: `train.fault.{rank,step}` kills that rank at that step (first
  attempt only), to test and demonstrate `--max-restarts`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from types import FrameType

from zerotrain.comm.launch import EXIT_INTERRUPTED
from zerotrain.config import FaultConfig  # EX_TEMPFAIL: try again later

_PR_SET_PDEATHSIG = 1
__all__ = ["EXIT_INTERRUPTED", "Interrupted", "Preemption", "die_with_parent",
           "maybe_inject_fault", "restart_count"]


class Interrupted(Exception):
    """Raised once the interrupted run has saved; the CLI turns it into one line."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"interrupted at step {step}; checkpoint saved ({checkpoint}); "
                         "resume with --resume")
        self.step = step


class Preemption:
    """SIGTERM/SIGINT handlers that only raise a flag (no exception mid-step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # else: leave signals alone
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
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
