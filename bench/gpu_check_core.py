"""bench/gpu_check.py's common part: the section list and caps, the report (table,
JSON, log), and `Ctx`, which runs a command or N ranks with a time cap and kills its
whole process group at the cap."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
VERIFY = BENCH / "gpu_verify"
ORDER = ["env", "setup", "probes", "review3", "race", "fp8", "init_mem", "pytest", "cli",
         "stages", "perf"]
# the one-GPU call (the fourth GPU review's section 5): cli's path is inside pytest; perf
# and stages need the time or the second GPU one call does not have (--sections adds them)
ONE_GPU = ["env", "setup", "probes", "review3", "race", "fp8", "init_mem", "pytest"]
# seconds each section may take on the GPU (ONE_GPU's sum to 450 s, the default budget);
# sections asked for beyond the budget get their caps scaled down to fit (`fit_caps`)
CAPS = {"env": 15, "setup": 45, "probes": 50, "review3": 110, "race": 45, "fp8": 45,
        "init_mem": 45, "pytest": 95, "cli": 100, "stages": 120, "perf": 200}
BUDGET = 450.0
WHOLE = float("inf")  # a command's cap: what is left of its section


def fit_caps(caps: dict[str, float], sections: list[str], budget: float) -> dict[str, float]:
    """The caps of the sections that run, scaled down together if they add up to more
    than the budget: every section gets its share, none is starved by those before it
    (perf, last, used to get nothing)."""
    run = [s for s in ORDER if s in sections]
    total = sum(caps[s] for s in run)
    scale = min(1.0, budget / total) if total else 1.0
    return {s: (caps[s] * scale if s in run else 0.0) for s in caps}
DRY_CAPS = {k: 150.0 for k in CAPS}  # generous: 2 shared cores can be slow
DRY_BUDGET = 1800.0  # the dry run tests the script: every section it is asked for runs
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT"}
STATUSES = ("PASS", "FAIL", "TIMEOUT", "REPRODUCED", "FIXED", "SKIP", "INFO", "UNTESTED")
# what one GPU cannot show (the review's section 4): rows when fewer than 2 GPUs
NEEDS_TWO = [
    ("zerotrain collectives on NCCL", "NCCL not exercised by zerotrain collectives at world "
     "size 1: Comm short-circuits every collective (C1's real dispatch, every stage's "
     "reduce-scatter / all-gather)"),
    ("H1 ring across ranks", "deadlock freedom of batched isend/irecv between ranks (probes "
     "cover the API at one rank)"),
    ("N1 end to end", "a 2-rank ZeRO-3 run with --precision.fp8.all_gather true, 32 steps "
     "bit for bit against plain FP8 (W-1; review3 covers the mechanism at a 2-rank "
     "layout, probes N1's)"),
    ("N3", "Offload compile vote vs publish order when a rank's first unit is padding"),
    ("S7", "two communicators (grad group) with concurrent kernels, and their overlap"),
    ("Muon on NCCL", "Muon's all_to_all / scatter / all_gather on NCCL"),
    ("ring speed", "--comm.algorithm ring against native NCCL"),
    ("--nproc N+1", "more ranks than GPUs refused at N >= 2 (pytest covers N = 1)"),
]


# ----------------------------------------------------------------------------- report


class Report:
    """Rows per section, the time budget, and the three result files."""

    def __init__(self, out: Path, budget: float, dry: bool):
        self.out, self.budget, self.dry = out, budget, dry
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.sections: dict[str, dict] = {}
        self.data: dict = {}
        self.log = out / "gpu_check.log"
        self.log.write_text("")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def add(self, section: str, check: str, status: str, detail: str = "") -> None:
        assert status in STATUSES, status
        detail = " ".join(str(detail).split())[:600]
        self.rows.append({"section": section, "check": check, "status": status,
                          "detail": detail})
        print(f"[gpu_check +{time.monotonic() - self.t0:4.0f}s] {section:8} {status:10} "
              f"{check}: {detail}", flush=True)

    def note(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(text)

    def section_status(self, name: str) -> str:
        got = {r["status"] for r in self.rows if r["section"] == name}
        for s in ("TIMEOUT", "FAIL", "REPRODUCED", "FIXED", "PASS", "INFO", "UNTESTED",
                  "SKIP"):
            if s in got:
                return s
        return "FAIL"

    def counts(self) -> dict[str, int]:
        return {s: sum(r["status"] == s for r in self.rows) for s in STATUSES}

    def write(self) -> None:
        env = self.data.get("env", {})

        def cell(x: str) -> str:
            return str(x).replace("|", "\\|")

        head = [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                + (" (dry run on CPU)" if self.dry else ""), "",
                f"{env.get('gpus_text', '?')}; torch {env.get('torch')}, CUDA "
                f"{env.get('cuda')}, NCCL {env.get('nccl')}; {self.elapsed():.0f} s of a "
                f"{self.budget:.0f} s budget", "",
                "| section | s | check | result | detail |", "|---|---|---|---|---|"]
        lines = [f"| {r['section']} | {self.sections.get(r['section'], {}).get('seconds', '')}"
                 f" | {cell(r['check'])} | {r['status']} | {cell(r['detail'])} |"
                 for r in self.rows]
        counts = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        (self.out / "gpu_check.md").write_text("\n".join([*head, *lines, "", counts, ""]))
        (self.out / "gpu_check.json").write_text(json.dumps(
            {"dry_run": self.dry, "budget_s": self.budget, "elapsed_s": round(self.elapsed(), 1),
             "order": ORDER, "sections": self.sections, "counts": self.counts(),
             "rows": self.rows, **self.data}, indent=1, default=str))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


# ----------------------------------------------------------------------------- commands


class Ctx:
    """What every section needs: the report, options, the Python and scratch folder."""

    def __init__(self, rep: Report, args: argparse.Namespace, work: Path):
        self.rep, self.args, self.work = rep, args, work
        self.dry: bool = args.dry_run
        self.py: str = sys.executable
        self.gpus = 0
        self.blocked: str | None = None  # why zerotrain cannot import (setup's verdict)
        self.deadline = 0.0  # of the running section

    def env(self, extra: dict | None = None) -> dict:
        path = [str(ROOT / "src"), str(ROOT / "tests")]
        if os.environ.get("PYTHONPATH"):
            path.append(os.environ["PYTHONPATH"])
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS
               and not k.startswith("TORCHELASTIC_")}  # ranks get their own, below
        env |= {"PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
               "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "LOGLEVEL": "ERROR"}
        if self.dry:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra or {})
        return env

    def run(self, cmd: list[str], cap: float, extra_env: dict | None = None,
            cwd: Path = ROOT) -> tuple[int, str]:
        """`cmd` in its own process group for at most min(cap, the section's time left);
        (exit code, output). 124: killed at the limit, with every child (torchrun's ranks
        too): a hang costs this command only."""
        limit = max(1.0, min(cap, self.deadline - time.monotonic()))
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env(extra_env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        ACTIVE.add(proc)
        try:
            text, _ = proc.communicate(timeout=limit)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            text, _ = proc.communicate()
            code = 124
            text = (text or "") + f"\n[gpu_check: killed after {limit:.0f} s]"
        finally:
            ACTIVE.discard(proc)
        self.rep.note(f"\n$ {' '.join(cmd)}  # {time.monotonic() - t0:.1f} s, exit {code}\n"
                      f"{text}\n")
        return code, text or ""

    def ranks(self, n: int, script: Path, args: list[str], cap: float,
              extra_env: dict | None = None) -> tuple[int, str]:
        """`n` ranks of `script` on this node, each with the variables torchrun would set
        (a launcher process less per job: the CLI section tests zerotrain's own launcher).
        A rank that fails gets the others 10 s to follow, then they are killed, as at the
        limit: a rank left waiting in a collective costs seconds, not the section."""
        limit = max(1.0, min(cap, self.deadline - time.monotonic()))
        t0 = time.monotonic()
        with socket.socket() as s:  # a free port for the rendezvous store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with contextlib.ExitStack() as files:
            outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(n)]
            procs = []
            for r in range(n):
                env = {**(extra_env or {}), "RANK": str(r), "WORLD_SIZE": str(n),
                       "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                procs.append(subprocess.Popen([self.py, str(script), *args], cwd=ROOT,
                                              env=self.env(env), text=True, stdout=outs[r],
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))
                ACTIVE.add(procs[-1])
            try:
                code = _wait_all(procs, t0 + limit)
            finally:
                ACTIVE.difference_update(procs)
            text = ""
            for r, f in enumerate(outs):
                f.seek(0)
                text += f"[rank {r}]\n{f.read()}"
        if code == 124:
            text += f"\n[gpu_check: killed after {limit:.0f} s]"
        self.rep.note(f"\n$ {n} rank(s): {self.py} {script} {' '.join(args)}  # "
                      f"{time.monotonic() - t0:.1f} s, exit {code}\n{text}\n")
        return code, text


ACTIVE: set[subprocess.Popen] = set()  # running children, each its own process group


def _stop(signum: int, frame: object) -> None:
    """Killed from outside (the caller's own time limit): the children live in their own
    sessions, so end them here; main's finally still writes the results."""
    for proc in list(ACTIVE):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> int:
    """The first failure's exit code (others get 10 s to follow, then are killed), 124 at
    the deadline, else 0."""
    first_failure = None
    while True:
        now = time.monotonic()
        codes = [q.poll() for q in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if all(c is not None for c in codes):
            code = bad[0] if bad else 0
            break
        if now > deadline:
            code = 124
            break
        if bad:
            first_failure = first_failure or now
            if now - first_failure > 10:
                code = bad[0]
                break
        time.sleep(0.1)
    for q in procs:
        if q.poll() is None:
            _kill_group(q)
    return code


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip() and not x.startswith("[W")]
    return lines[-1][:300] if lines else ""


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def failed(ctx: Ctx, section: str, what: str, code: int, text: str) -> None:
    ctx.rep.add(section, what, "TIMEOUT" if code == 124 else "FAIL",
                f"exit {code}: {last_line(text)}")
