"""Launch one bench/capacity.py run (N rank processes) under a per-rank memory cap.

The ranks are started directly (the environment torchrun would give them), so their
process ids are known, and watched from this process every `POLL_S`:

- a rank whose resident set passes the cap is a run that does not fit: every rank is
  killed at once (the verdict is "oom", with the phase the rank was in), which also keeps
  the machine safe — it is shared, and a run past its cap could starve the others;
- the machine's `MemAvailable` falling under a floor stops the run too ("aborted": not a
  verdict on the system, the machine was short);
- after a clean exit, a per-rank peak (the worker's own high-water marks, or the
  watchdog's samples, whichever is larger) over the cap is "oom" as well: sampling can
  miss a short spike, the high-water mark cannot.

With `cgroup` set (a directory of a memory cgroup this user may create children in:
cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`), each rank also runs in its own
child cgroup limited to the cap, so the kernel enforces it; the watchdog stays on as the
second line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "capacity_worker.py"
POLL_S = 0.05
GiB = 2**30


def proc_kib(pid: int, key: str, path: str = "status") -> int | None:
    """A `key:  N kB` field of /proc/<pid>/<path> in bytes (None when gone)."""
    try:
        with open(f"/proc/{pid}/{path}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- cgroups
def own_memory_cgroup() -> Path | None:
    """This process's memory cgroup directory (v2 unified, else v1 memory), if mounted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if ctrls == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (d / "cgroup.controllers").read_text().split():
                return d
        if "memory" in ctrls.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


def cgroup_report() -> dict[str, Any]:
    """What this machine offers (recorded with the results): version, place, writable."""
    d = own_memory_cgroup()
    if d is None:
        return {"available": False}
    v2 = (d / "memory.max").exists()
    return {"available": True, "version": 2 if v2 else 1, "own": str(d),
            "writable": os.access(d, os.W_OK)}


class RankCgroup:
    """A child memory cgroup limited to `cap` bytes, for one rank (removed afterwards)."""

    def __init__(self, parent: Path, name: str, cap: int):
        self.dir = parent / name
        self.dir.mkdir(exist_ok=True)
        v2 = (parent / "memory.max").exists() or (self.dir / "memory.max").exists()
        limit = "memory.max" if v2 else "memory.limit_in_bytes"
        (self.dir / limit).write_text(str(cap))
        if v2 and (self.dir / "memory.swap.max").exists():
            (self.dir / "memory.swap.max").write_text("0")
        self.v2 = v2

    def enter(self) -> None:
        """Runs in the child between fork and exec: the rank starts inside its cgroup."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def oom_killed(self) -> bool:
        name, key = ("memory.events", "oom_kill") if self.v2 else ("memory.oom_control",
                                                                    "oom_kill")
        try:
            for line in (self.dir / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v) > 0
        except OSError:
            return False
        return False

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.dir.rmdir()


# ---------------------------------------------------------------------------- one run
def spawn(cmd: list[str], rank: int, world: int, port: int, log: Path,
          group: RankCgroup | None) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=HERE.parent, start_new_session=True,
                                preexec_fn=group.enter if group else None)


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started
    for p in procs:
        p.wait()


def watch(procs: Sequence[subprocess.Popen], cap: int, floor: int, timeout: float
          ) -> tuple[str | None, int | None, list[int]]:
    """Poll until every rank exits. Returns (stop reason or None, rank that caused it,
    max sampled RSS per rank)."""
    seen = [0] * len(procs)
    t_end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            rss = proc_kib(p.pid, "VmRSS") or 0
            seen[r] = max(seen[r], rss)
            if rss > cap:
                kill_all(procs)
                return "oom", r, seen
        if any(p.poll() not in (None, 0) for p in procs):  # a rank failed: the others
            time.sleep(2)                                     # would wait in a collective
            kill_all(procs)
            return None, None, seen
        if mem_available() < floor:
            kill_all(procs)
            return "aborted: machine memory low", None, seen
        if time.monotonic() > t_end:
            kill_all(procs)
            return "timeout", None, seen
        time.sleep(POLL_S)
    return None, None, seen


def run_once(system: str, model: dict, *, cap: int, out: Path, world: int = 2,
             steps: int = 3, python: str = sys.executable, timeout: float = 1200,
             floor: int = int(1.5 * GiB), cgroup: Path | None = None,
             extra: Sequence[str] = ()) -> dict[str, Any]:
    """One run; the worker's JSON plus the verdict: ok | oom | failed | timeout | aborted."""
    for old in out.parent.glob(out.name + "*"):
        old.unlink()
    cmd = [python, str(WORKER), "--system", system, "--model", json.dumps(model),
           "--out", str(out), "--steps", str(steps), *extra]
    port = free_port()
    groups = [RankCgroup(cgroup, f"zt-capacity-{os.getpid()}-r{r}", cap) if cgroup else None
              for r in range(world)]
    t0 = time.perf_counter()
    procs = [spawn(cmd, r, world, port, Path(f"{out}.rank{r}.log"), groups[r])
             for r in range(world)]
    try:
        stop, who, seen = watch(procs, cap, floor, timeout)
    finally:
        kill_all(procs)
    res = verdict(out, stop, who, seen, procs, groups, cap)
    for g in groups:
        if g is not None:
            g.remove()
    res.update(system=system, model=model, cap_bytes=cap, wall_s=time.perf_counter() - t0,
               sampled_peak_rss=seen, log=str(out) + ".rank0.log")
    return res


def verdict(out: Path, stop: str | None, who: int | None, seen: list[int],
            procs: Sequence[subprocess.Popen], groups: list, cap: int) -> dict[str, Any]:
    phases = [Path(f"{out}.rank{r}.phase") for r in range(len(procs))]
    where = [p.read_text() if p.exists() else "?" for p in phases]
    if stop is not None:
        r = who if who is not None else 0
        return {"ok": False, "verdict": stop.split(":")[0], "error": stop, "oom_rank": who,
                "oom_phase": where[r]}
    if any(g is not None and g.oom_killed() for g in groups):
        r = next(i for i, g in enumerate(groups) if g is not None and g.oom_killed())
        return {"ok": False, "verdict": "oom", "error": "killed by its cgroup's limit",
                "oom_rank": r, "oom_phase": where[r]}
    if out.exists():
        res = json.loads(out.read_text())
        peaks = [max(rk["peak"], s) for rk, s in zip(res["ranks"], seen)]
        res["peak_rss"] = peaks
        if max(peaks) > cap:
            r = peaks.index(max(peaks))
            res.update(ok=False, verdict="oom", oom_rank=r, oom_phase="peak over cap",
                       error=f"peak {peaks[r] / GiB:.2f} GiB over the cap")
        else:
            res["verdict"] = "ok"
        return res
    errs = sorted(out.parent.glob(out.name + ".rank*.err"))
    if errs:
        res = json.loads(errs[0].read_text())
        res["verdict"] = "failed"
        return res
    codes = [p.returncode for p in procs]
    return {"ok": False, "verdict": "failed", "error": f"exit codes {codes}; see logs",
            "oom_phase": where[0]}
