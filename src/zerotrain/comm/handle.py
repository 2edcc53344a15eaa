"""What an asynchronous collective returns, and the thread that runs ring jobs on gloo.

On gloo, async ring collectives run on one worker thread, where they overlap the
caller's computation. On NCCL they run on the calling thread: NCCL calls already return
at once (the GPU does the waiting), a second thread would only queue its transfers on
the device's default stream behind the training kernels, and two host threads driving
two NCCL communicators in per-rank orders can deadlock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Handle:
    """Uniform wait() over a torch Work, a ring job on the comm thread, or nothing.

    `explain` turns a backend timeout into an error that names the setting."""

    def __init__(self, work: object | None = None, done: threading.Event | None = None,
                 explain: Callable[[BaseException], BaseException] | None = None):
        self._work = work
        self._done = done
        self._error: BaseException | None = None
        self._explain = explain

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                better = self._explain(e) if self._explain is not None else e
                if better is e:
                    raise
                raise better from e
            self._work = None
        if self._done is not None:
            self._done.wait()
            if self._error is not None:
                raise self._error


class CommThread:
    """One FIFO worker per process: async ring collectives run here, in submission order.

    Every rank submits the collectives of each group in the same order, so the
    point-to-point exchanges pair up; the ring jobs use process groups of their own, so
    they never interleave with main-thread calls on the same group. A Comm's gradient
    group and its subgroups share their parent's thread.
    """

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="zerotrain-comm", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, handle = job
            try:
                fn()
            except BaseException as e:  # surfaced on wait()
                handle._error = e
            handle._done.set()

    def submit(self, fn: Callable[[], None]) -> Handle:
        h = Handle(done=threading.Event())
        self._q.put((fn, h))
        return h

    def close(self) -> None:
        """Finish the jobs already queued, then stop."""
        self._q.put(None)
        self._t.join(timeout=30)
