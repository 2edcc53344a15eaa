"""The one way tests run several ranks: N gloo processes on localhost, kept warm.

`run_ranks(fn, n, *args)` runs `fn(*args)` on n ranks, each with the environment torchrun
would set (RANK, WORLD_SIZE, MASTER_ADDR/PORT on a free port) and a gloo group opened for
this call, and returns the per-rank results in rank order. `fn` must be importable
(module level): the ranks import it by its module path.

Why a pool: spawning a rank (importing torch and zerotrain, joining gloo) costs ~3 CPU-s,
and the suite calls `run_ranks` ~70 times. So the n processes of a world size stay alive
between calls (a session-wide pool per world size, at most `MAX_WARM` ranks warm in all).
Each call still gets a fresh process group on a new port, the caller's environment
variables, the process's initial RNG state and torch defaults. A pool is retired, never
reused, after a call in which any rank

- raised (the call fails with that rank's traceback: "rank r failed: ..."),
- died (its exit code is named), or hung past `timeout` (every unfinished rank's Python
  stack, dumped by faulthandler, is in the error), or
- left process state behind that a later call could see: a module attribute of zerotrain
  or of a test module rebound (a monkeypatch not undone), a function defined in the
  tests or a mock left in such a module, or a thread left running.

`run_ranks(..., fresh=True)`, or ZEROTRAIN_TEST_POOL=0 for every call, gives processes
used once (for tests about process start-up itself).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_WARM = int(os.environ.get("ZEROTRAIN_TEST_POOL_RANKS", "9"))  # warm ranks, all pools
DUMP = signal.SIGUSR2  # a worker asked for its stack (faulthandler); zerotrain never uses it
TESTS = str(Path(__file__).resolve().parent)
# torch modules tests reach into: a function written in the tests left there is a patch
PATCHED = (
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.utils.checkpoint",
    "torch.nn.functional",
    "torch.cuda",
    "os",
    "time",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the rank side


def _watched_modules() -> list[tuple[str, Any]]:
    """zerotrain's modules and the tests' own: what a test might patch and forget (torch's
    own modules rebind their globals as they run, so only `_foreign` looks at them)."""
    out = []
    for name, m in list(sys.modules.items()):
        f = getattr(m, "__file__", None) or ""
        if name.startswith("zerotrain") or f.startswith(TESTS):
            out.append((name, m))
    return out


def _fingerprint() -> dict[tuple[str, str], int]:
    """id() of every module attribute and of every attribute of the classes a watched
    module defines: a rebinding (monkeypatch, `mod.f = g`) changes one."""
    ids: dict[tuple[str, str], int] = {}
    for name, m in _watched_modules():
        for k, v in list(vars(m).items()):
            ids[name, k] = id(v)
            if isinstance(v, type) and v.__module__ == name:
                for ck, cv in list(vars(v).items()):
                    ids[f"{name}.{k}", ck] = id(cv)
    return ids


def _left_behind(before: dict, threads: int) -> str:
    """What a call changed that the next one would see ('' if nothing)."""
    import threading

    after = _fingerprint()
    moved = [f"{m}.{k}" for (m, k), i in before.items() if after.get((m, k), i) != i]
    moved += _foreign()  # also in modules first imported by this call
    if moved:
        return "rebound " + ", ".join(sorted(set(moved))[:5])
    if threading.active_count() > threads:
        return f"{threading.active_count() - threads} thread(s) still running"
    return ""


def _foreign() -> list[str]:
    """Attributes of zerotrain's modules and classes (and of a few torch modules) that
    hold a function written in the tests or a mock: a patch, whenever the module was
    imported."""
    spaces = [(n, vars(m)) for n in PATCHED if (m := sys.modules.get(n)) is not None]
    for name, m in _watched_modules():
        if name.startswith("zerotrain"):
            spaces.append((name, vars(m)))
            spaces += [
                (f"{name}.{k}", vars(v))
                for k, v in list(vars(m).items())
                if isinstance(v, type) and v.__module__ == name
            ]
    found = []
    for where, space in spaces:
        for k, v in list(space.items()):
            kind = type(v)  # never the object's own attributes: some warn when read
            if (
                kind is types.FunctionType and v.__code__.co_filename.startswith(TESTS)
            ) or kind.__module__ == "unittest.mock":
                found.append(f"{where}.{k}")
    return found


class _Defaults:
    """The process's state as spawned, restored before every call."""

    def __init__(self) -> None:
        import torch

        self.rng = torch.random.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.det = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self, caller: dict, rank: int, world: int, port: int) -> None:
        """The caller's environment, working folder and import path (as a spawn would
        copy them), the spawned process's torch defaults and RNG."""
        import torch

        os.environ.clear()
        os.environ.update(caller["env"])
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        os.chdir(caller["cwd"])
        sys.path[:0] = [p for p in caller["path"] if p not in sys.path]
        torch.random.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.det[0], warn_only=self.det[1])
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        for s, h in self.signals.items():
            signal.signal(s, h)
        if "torch._dynamo" in sys.modules:  # a compiled function starts cold, as when spawned
            torch._dynamo.reset()


def _call(rank: int, world: int, payload: bytes) -> tuple[bool, bytes | str]:
    import torch
    import torch.distributed as dist

    try:
        fn, args = torch.load(io.BytesIO(payload), weights_only=False)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        dist.barrier()
        # serialised here: tensors sent through a Queue share memory with this process
        buf = io.BytesIO()
        torch.save(result, buf)
        return True, buf.getvalue()
    except BaseException:  # reported before the group closes: its peers fail after it
        return False, traceback.format_exc()


def _worker(rank: int, world: int, jobs, results, dump: str) -> None:
    """One warm rank: runs calls until told to stop (None) or until its pool is retired."""
    import faulthandler
    import threading

    import torch

    torch.set_num_threads(1)
    with open(dump, "w") as f:
        faulthandler.register(DUMP, file=f, all_threads=True)
        defaults = _Defaults()
        while (job := jobs.get()) is not None:
            job_id, port, caller, payload = job
            defaults.restore(caller, rank, world, port)
            before, threads = _fingerprint(), threading.active_count()
            ok, out = _call(rank, world, payload)
            if not ok:
                results.put((job_id, rank, ok, out, ""))
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            if ok:
                results.put((job_id, rank, ok, out, _left_behind(before, threads)))


# ----------------------------------------------------------------------------- the test side


class _Pool:
    """`world` warm ranks; `run` is one call on all of them."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.jobs_done = world, 0
        self.dir = tempfile.mkdtemp(prefix=f"zerotrain-ranks{world}-")
        self.dumps = [os.path.join(self.dir, f"rank{r}.stack") for r in range(world)]
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                name=f"rank{r}-of-{world}",
                args=(r, world, self.jobs[r], self.results, self.dumps[r]),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.usable = True

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        import torch

        buf = io.BytesIO()
        torch.save((fn, args), buf)
        caller = {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
        job = (self.jobs_done, free_port(), caller, buf.getvalue())
        for q in self.jobs:
            q.put(job)
        got, errors, dirty = self._collect(timeout)
        self.jobs_done += 1
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        if dirty:  # correct results, but the next call would inherit this state
            _note(
                f"world-{self.world} ranks retired after "
                f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}: "
                f"{dirty[0]}"
            )
            self.close()
        return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(self.world)]

    def _collect(self, timeout: float) -> tuple[dict[int, bytes], list[str], list[str]]:
        got: dict[int, bytes] = {}
        errors: list[str] = []
        dirty: list[str] = []
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                job_id, rank, ok, out, left = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in got and not p.is_alive()]
                if dead:
                    errors += [
                        f"rank {r} died (exit code {self.procs[r].exitcode}) without a result"
                        for r in dead
                    ]
                    return got, errors, dirty
                if time.monotonic() > deadline:
                    errors.append(
                        self._hung([r for r in range(self.world) if r not in got], timeout)
                    )
                    return got, errors, dirty
                continue
            assert job_id == self.jobs_done, (job_id, self.jobs_done)
            if not ok:
                errors.append(f"rank {rank} failed:\n{out}")
                return got, self._more_errors(errors), dirty
            got[rank] = out
            if left:
                dirty.append(f"rank {rank}: {left}")
        return got, errors, dirty

    def _more_errors(self, errors: list[str]) -> list[str]:
        """The others' errors that follow within 2 s (the rest may wait in a collective);
        a peer's "connection closed" comes after the error that caused it."""
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                _, rank, ok, out, _ = self.results.get(timeout=0.1)
            except queue.Empty:
                continue
            if not ok:
                errors.append(f"rank {rank} failed:\n{out}")
        return sorted(errors, key=lambda e: "Connection closed by peer" in e)

    def _hung(self, ranks: list[int], timeout: float) -> str:
        for r in ranks:
            if self.procs[r].pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.procs[r].pid, DUMP)
        time.sleep(1.0)
        stacks = []
        for r in ranks:
            try:
                text = Path(self.dumps[r]).read_text()
            except OSError:
                text = "(no stack)"
            stacks.append(f"--- rank {r} ---\n{text[-6000:]}")
        return (
            f"rank(s) {ranks} did not finish within {timeout:.0f} s; their stacks "
            "(the last dump is the hang):\n" + "\n".join(stacks)
        )

    def close(self) -> None:
        """Stop the ranks (politely if idle, else terminated) and forget the pool."""
        if not self.usable:
            return
        self.usable = False
        _note(f"world-{self.world} ranks stopped after {self.jobs_done} call(s)", False)
        if _POOLS.get(self.world) is self:
            del _POOLS[self.world]
        for q in self.jobs:
            with contextlib.suppress(Exception):
                q.put_nowait(None)
        for p in self.procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for q in (*self.jobs, self.results):
            q.cancel_join_thread()
            q.close()


def _note(text: str, stderr: bool = True) -> None:
    """To stderr (shown with a failing test) and to $ZEROTRAIN_TEST_POOL_LOG if set."""
    if stderr:
        print(f"[multirank] {text}", file=sys.stderr)
    if os.environ.get("ZEROTRAIN_TEST_POOL_LOG"):
        with open(os.environ["ZEROTRAIN_TEST_POOL_LOG"], "a") as f:
            f.write(text + "\n")


_POOLS: dict[int, _Pool] = {}  # by world size, least recently used first


def _pool(world: int) -> _Pool:
    pool = _POOLS.pop(world, None)
    if pool is None or not pool.usable or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        while _POOLS and sum(_POOLS) + world > MAX_WARM:
            _POOLS[next(iter(_POOLS))].close()
        pool = _Pool(world)
    _POOLS[world] = pool  # most recently used last
    return pool


def shutdown() -> None:
    """Stop every warm rank (the end of the test session)."""
    for pool in list(_POOLS.values()):
        pool.close()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 300, fresh: bool = False
) -> list[Any]:
    """fn(*args) on `world_size` gloo ranks; the results in rank order. A rank's error or
    a hang fails the call with the rank's traceback or stack."""
    if fresh or os.environ.get("ZEROTRAIN_TEST_POOL") == "0":
        pool = _Pool(world_size)
        try:
            return pool.run(fn, args, timeout)
        finally:
            pool.close()
    pool = _pool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        pool.close()
        raise
