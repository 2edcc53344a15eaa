"""The one-call GPU check (issue 21; the third GPU review's section 8): run it through
`bash bench/gpu_check.sh`. On one H200 it keeps to --budget (480 s by default); each
section is a subprocess group with its own time cap (a hang kills that section only, then
the next starts); a failure never stops the run. `--dry-run` runs every section on the
CPU (gloo ranks, tiny sizes, stand-ins named in each row) to test this script.

Sections, in order (FP8 early, perf last):
  env       nvidia-smi, torch / CUDA / NCCL versions, capability
  setup     zerotrain's needs (pyproject.toml) and pytest; if missing, a venv with them
            (pip -c constraints.txt; offline: from --wheels) and the project installed
  probes    over one NCCL rank: C1, H1 API, S3, FP8 _scaled_mm contract and recipes, N1,
            C2, N2, N9 (bench/gpu_verify/probes.py)
  fp8       bench/gpu_check_fp8.py: path, 8192^2 fwd+bwd speed and error, GPT bf16 vs FP8
  race      Offload under delayed copies: normal / GPU sleeps before every async copy /
            CUDA_LAUNCH_BLOCKING=1, bit for bit (bench/gpu_verify/offload_race.py)
  init_mem  ZeRO-3's CUDA init peak, 8 processes on the one GPU over gloo, vs its bound
            and the estimator's prediction (N4) (bench/gpu_verify/init_mem.py)
  pytest    pytest -m gpu tests/test_gpu.py tests/test_fp8.py
  cli       zerotrain train through the launcher (torchrun, NCCL) and sample from its
            checkpoint
  stages    every stage at N GPUs against one process (N >= 2; one GPU: what it cannot test)
  perf      zerotrain ZeRO-3 vs FSDP2, both built on meta (bench/gpu_check_workers.py)
Multi-rank jobs are started by this driver with the variables torchrun sets (one process
less per job); the cli section goes through zerotrain's own launcher (torchrun).
Results in --out: gpu_check.md (table), gpu_check.json, gpu_check.log (every command's
output). Scratch (run folders, saved tensors) in --work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
VERIFY = BENCH / "gpu_verify"
ORDER = ["env", "setup", "probes", "fp8", "race", "init_mem", "pytest", "cli", "stages",
         "perf"]
# seconds each section may take on the GPU; dry-run caps are in DRY_CAPS
CAPS = {"env": 20, "setup": 120, "probes": 90, "fp8": 75, "race": 150, "init_mem": 100,
        "pytest": 160, "cli": 100, "stages": 120, "perf": 200}
WHOLE = float("inf")  # a command's cap: what is left of its section
DRY_CAPS = {k: 150.0 for k in CAPS}  # generous: 2 shared cores can be slow
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
    ("N1 end to end", "a 2-rank ZeRO-3 run with --precision.fp8.all_gather true (probes "
     "cover the mechanism at a 2-rank layout)"),
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


# ----------------------------------------------------------------------------- env


def section_env(ctx: Ctx) -> None:
    rep = ctx.rep
    smi = shutil.which("nvidia-smi")
    if smi:
        code, text = ctx.run([smi, "-L"], 15)
        rep.add("env", "nvidia-smi -L", "INFO" if code == 0 else "FAIL", last_line(text))
    elif not ctx.dry:
        rep.add("env", "nvidia-smi", "FAIL", "not on PATH")
    code, text = ctx.run([ctx.py, "-c", ENV_PROBE], 60)
    info = _json_line(text)
    if info is None:
        rep.add("env", "torch", "FAIL", f"{ctx.py} cannot report torch: {last_line(text)}")
        ctx.blocked = "torch does not import"
        return
    info["python"] = ctx.py
    info["gpus_text"] = (f"{len(info['gpus'])} x {info['gpus'][0]} ({info['gpu_mem_gib'][0]} "
                         f"GiB, sm_{info['capability'][0]}{info['capability'][1]})"
                         if info["gpus"] else "no GPU")
    rep.data["env"] = info
    ctx.gpus = len(info["gpus"])
    rep.add("env", "torch / CUDA / NCCL", "INFO",
            f"python {info['python_version']}, torch {info['torch']}, CUDA {info['cuda']}, "
            f"NCCL {info['nccl']}, {info['gpus_text']}")
    if ctx.dry:
        rep.add("env", "dry run", "INFO", "CPU: gloo ranks, tiny sizes, stand-ins named "
                "per row; nothing here is a GPU result")
    elif not info["gpus"]:
        rep.add("env", "CUDA", "FAIL", "no CUDA device visible to this torch; every GPU "
                "section is skipped (--dry-run tests the script on CPU)")
        ctx.blocked = "no CUDA device"
    else:
        cap = tuple(info["capability"])
        rep.add("env", "FP8 matmul", "INFO" if cap >= (8, 9) else "SKIP",
                f"sm_{cap[0]}{cap[1]}: " + ("torch._scaled_mm available" if cap >= (8, 9)
                                            else "no FP8 tensor cores (needs sm_89+)"))


ENV_PROBE = """
import json, platform, torch
cuda = torch.cuda.is_available()
n = torch.cuda.device_count() if cuda else 0
props = [torch.cuda.get_device_properties(i) for i in range(n)]
try:
    v = torch.cuda.nccl.version() if cuda else None
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else v
except Exception as e:
    nccl = f"unknown ({type(e).__name__})"
print(json.dumps({"python_version": platform.python_version(), "torch": torch.__version__,
    "cuda": torch.version.cuda, "nccl": nccl, "gpus": [p.name for p in props],
    "gpu_mem_gib": [round(p.total_memory / 2**30, 1) for p in props],
    "capability": list(torch.cuda.get_device_capability(0)) if n else None}))
"""


def _json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# ----------------------------------------------------------------------------- setup


def section_setup(ctx: Ctx) -> None:
    """zerotrain's needs from the tracked pyproject.toml; what is missing goes into a venv
    that also sees the image's packages (its CUDA torch above all), installed with
    pip -c constraints.txt from --wheels (offline) or the package index, bounded in time:
    no index reachable and no wheels is one clear FAIL, not a hang."""
    rep, a = ctx.rep, ctx.args
    pretend = ["--pretend-missing", *a.pretend_missing] if a.pretend_missing else []
    check = [str(VERIFY / "deps.py"), *pretend]
    code, text = ctx.run([ctx.py, *check], 60)
    info = _json_line(text)
    if info is None:
        rep.add("setup", "dependency check", "FAIL", last_line(text))
        ctx.blocked = "the dependency check failed"
        return
    rep.data["deps"] = info
    if not info["missing"]:
        rep.add("setup", "zerotrain's needs and pytest", "PASS",
                f"all import with {ctx.py}: " + ", ".join(f"{k} {v}" for k, v in
                                                          info["present"].items()))
        return
    missing = info["missing"]
    rep.add("setup", "missing here", "INFO", ", ".join(missing))
    venv = ctx.work / "venv"
    vpy = venv / "bin" / "python"
    if not vpy.exists():
        code, text = ctx.run([ctx.py, "-m", "venv", "--without-pip", str(venv)], 60)
        if code:
            rep.add("setup", "venv", "FAIL", last_line(text))
            ctx.blocked = "missing " + ", ".join(missing)
            return
    # the new venv sees this Python's packages (torch, pip) after its own
    code, text = ctx.run([ctx.py, "-c", "import json, site, sys; print(json.dumps("
                          "[p for p in sys.path if p.endswith(('site-packages', "
                          "'dist-packages'))]))"], 30)
    parents = json.loads(text.strip().splitlines()[-1]) if code == 0 else []
    code, text = ctx.run([str(vpy), "-c", "import site; print(site.getsitepackages()[0])"], 30)
    # addsitedir, not bare paths: the image's own .pth files (namespace packages, editable
    # installs) are processed too
    (Path(text.strip().splitlines()[-1]) / "zz_image_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    wheels = a.wheels or os.environ.get("ZEROTRAIN_WHEELS") or (
        str(ROOT / ".whl") if (ROOT / ".whl").is_dir() else None)
    source = (["--no-index", "--find-links", wheels] if wheels else
              ["--timeout", "10", "--retries", "1"])
    pip = [str(vpy), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--no-cache-dir", "-q", "-c", str(ROOT / "constraints.txt")]
    code, text = ctx.run([*pip, *source, *missing], 150)
    how = f"from {wheels}" if wheels else "from the package index"
    pip_said = "done" if code == 0 else f"exit {code}: {last_line(text)}"
    rep.add("setup", f"pip install {how}", "INFO", pip_said)
    code, text = ctx.run([str(vpy), *check], 60)
    info = _json_line(text) or {"missing": missing}
    if info["missing"]:
        ctx.blocked = "missing " + ", ".join(info["missing"])
        rep.add("setup", "zerotrain's needs and pytest", "FAIL",
                f"still missing: {', '.join(info['missing'])} (pip {how}: {pip_said[:200]})"
                ". Run `bash bench/gpu_check.sh --fetch-wheels` where pip works and "
                "bring .whl/ along (the device tool: carry ['.whl'])")
        return
    code, text = ctx.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], 90)
    rep.add("setup", "the project into the venv (pip install -e ., tracked files)",
            "INFO", "installed" if code == 0 else f"not installed ({last_line(text)[:160]}); "
            "the sections run it from src/ (PYTHONPATH) either way")
    ctx.py = str(vpy)
    rep.add("setup", "zerotrain's needs and pytest", "PASS", f"installed into {venv}")


# ----------------------------------------------------------------------------- probes


def section_probes(ctx: Ctx) -> None:
    out = ctx.work / "probes"
    out.mkdir(exist_ok=True)
    n = 2 if ctx.dry else 1  # gloo cannot send to itself: two CPU ranks stand in
    code, text = ctx.ranks(n, VERIFY / "probes.py", ["--out", str(out), *_dry(ctx)],
                              WHOLE)
    res = read_json(out / "probes.json")
    for r in (res or {}).get("rows", []):
        ctx.rep.add("probes", r["check"], r["status"], r["detail"])
    if code or not res:
        failed(ctx, "probes", "probes.py (torchrun)", code, text)


def _dry(ctx: Ctx) -> list[str]:
    return ["--dry-run"] if ctx.dry else []


# ----------------------------------------------------------------------------- fp8


def section_fp8(ctx: Ctx) -> None:
    cap = (ctx.rep.data.get("env") or {}).get("capability")
    if not ctx.dry and cap and tuple(cap) < (8, 9):
        ctx.rep.add("fp8", "FP8 path", "SKIP", f"sm_{cap[0]}{cap[1]}: needs sm_89+")
        return
    code, text = ctx.run([ctx.py, str(BENCH / "gpu_check_fp8.py"), "--out", str(ctx.work),
                          *_dry(ctx)], WHOLE)
    r = read_json(ctx.work / "fp8.json")
    if not r or not r.get("ok"):
        if r and r.get("error"):
            ctx.rep.add("fp8", "FP8 path", "FAIL", r["error"])
        else:
            failed(ctx, "fp8", "gpu_check_fp8.py", code, text)
        return
    ctx.rep.data["fp8"] = r
    for row in r["rows"]:
        ctx.rep.add("fp8", row["check"], row["status"], row["detail"])


# ----------------------------------------------------------------------------- race


def section_race(ctx: Ctx) -> None:
    """normal and sleep in one process, then the CUDA_LAUNCH_BLOCKING=1 run, which also
    compares the three bit for bit."""
    out = ctx.work / "race"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = [ctx.py, str(VERIFY / "offload_race.py"), "--out-dir", str(out), *_dry(ctx),
              *(["--steps", "3"] if ctx.dry else [])]
    if ctx.dry:  # CUDA_LAUNCH_BLOCKING means nothing on the CPU: one process for all three
        code, text = ctx.run([*script, "--runs", "normal", "sleep", "blocking", "--compare"],
                             90)
    else:
        code, text = ctx.run([*script, "--runs", "normal", "sleep"], 90)
        if code:
            failed(ctx, "race", "runs normal, sleep", code, text)
        code, text = ctx.run([*script, "--runs", "blocking", "--compare"], 60,
                             {"CUDA_LAUNCH_BLOCKING": "1"})
    rows = read_json(out / "race.json")
    if not rows:
        failed(ctx, "race", "run blocking and compare", code, text)
        return
    how = ("CPU: copies are synchronous, the sleeps pass through (script test only)"
           if ctx.dry else "GPU sleeps of ~10 ms before every async copy")
    for r in rows:
        if r["run"] == r["vs"]:
            continue
        f = r["facts"]
        ctx.rep.add("race", f"{r['case']}: {r['run']} vs {r['vs']}",
                    "PASS" if r["identical"] else "FAIL",
                    f"losses identical {r['losses_identical']}, max |param diff| "
                    f"{r['max_param_diff']:.3g}; step_by_unit {f['step_by_unit']}, pinned "
                    f"{f['pinned']}, {f['units']} units; {how}")


# ----------------------------------------------------------------------------- init_mem


def section_init_mem(ctx: Ctx) -> None:
    out = ctx.work / "init_mem"
    out.mkdir(exist_ok=True)
    # the dry run: one CPU rank (the same per-rank path, a torch import less)
    n, preset, vocab = ((1, "gpt-tiny", 512) if ctx.dry else
                        (ctx.args.init_ranks, ctx.args.preset, 32000))
    code, text = ctx.ranks(n, VERIFY / "init_mem.py", ["--preset", preset, "--vocab",
                                                       str(vocab), "--out", str(out),
                                                       *_dry(ctx)],
                              WHOLE, {"OMP_NUM_THREADS": "2"})
    res = read_json(out / "init_mem.json")
    if not res:
        failed(ctx, "init_mem", f"{n} ranks on one GPU over gloo", code, text)
        return
    ranks = res["ranks"]
    worst = max(ranks, key=lambda r: r["peak_mib"] - r["bound_mib"])
    detail = (f"{preset}, {n} processes on one device over gloo: max peak "
              f"{max(r['peak_mib'] for r in ranks):.0f} MiB vs bound "
              f"{worst['bound_mib']:.0f} MiB (shards + masters + grads + widest param + "
              f"largest unit + 64 MiB); estimator's init "
              f"{worst['predicted_init_mib']:.0f} MiB; before C4 {worst['old_mib']:.0f} MiB; "
              f"init {max(r['init_s'] for r in ranks)} s")
    if not res["measured"]:
        ctx.rep.add("init_mem", "ZeRO-3 init at N ranks (C4, N4)", "SKIP",
                    "CPU: no CUDA peak to measure (the logic ran): " + detail)
    else:
        ctx.rep.add("init_mem", "ZeRO-3 CUDA init peak per rank (C4, N4)",
                    "PASS" if res["ok"] else "FAIL", detail)
        # N4: the estimator must state the CUDA bound (the transient unit included)
        over = [r for r in ranks if r["peak_mib"] > 1.05 * r["predicted_init_mib"] + 16]
        top = max(ranks, key=lambda r: r["peak_mib"] / max(r["predicted_init_mib"], 1e-9))
        ctx.rep.add("init_mem", "N4: the estimator's init prediction covers the CUDA peak",
                    "REPRODUCED" if over else "FIXED",
                    f"rank {top['rank']}: measured {top['peak_mib']:.0f} MiB, predicted "
                    f"{top['predicted_init_mib']:.0f} MiB (tolerance 5% + 16 MiB); "
                    f"{len(over)} of {len(ranks)} ranks above it")


# ----------------------------------------------------------------------------- pytest


def section_pytest(ctx: Ctx) -> None:
    what = "pytest -m gpu tests/test_gpu.py tests/test_fp8.py"
    code, text = ctx.run([ctx.py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          "tests/test_gpu.py", "tests/test_fp8.py"], WHOLE)
    tail = last_line(text)
    if code == 124:
        failed(ctx, "pytest", what, code, text)
    elif ctx.dry:
        ok = code in (0, 5) and "skipped" in tail
        ctx.rep.add("pytest", what, "SKIP" if ok else "FAIL",
                    f"CPU: every gpu-marked test skips ({tail})")
    else:
        ctx.rep.add("pytest", f"{what}: every stage and Offload at N=1 vs CPU, pinned "
                    "states, CLI sample + resume, --nproc N+1 is one error, _scaled_mm vs "
                    "emulation", "PASS" if code == 0 else "FAIL", tail)


# ----------------------------------------------------------------------------- cli


def section_cli(ctx: Ctx) -> None:
    """Through the launcher even at one rank (--max-restarts 1 makes --nproc 1 go through
    torchrun): rendezvous, NCCL's eager init with device_id, barriers, checkpoints,
    shutdown; then `zerotrain sample` from the checkpoint. (Resume in one process is
    pytest's test_one_gpu_cli_sample_and_resume.)"""
    rep = ctx.rep
    world = 1 if ctx.dry else max(1, ctx.gpus)  # the dry run mirrors one GPU
    dev = "cpu" if ctx.dry else "cuda"
    full = ctx.work / "cli"
    base = [ctx.py, "-m", "zerotrain", "train", "--model.n_layer", "2", "--model.n_embd",
            "64", "--model.n_head", "2", "--model.block_size", "64", "--data.path",
            str(ROOT / "README.md"), "--data.micro_batch_size", "4", "--schedule.kind",
            "constant", "--schedule.warmup_steps", "0", "--precision.dtype", "bf16",
            "--zero.stage", "3", "--train.device", dev, "--logging.progress", "false",
            "--logging.plot", "false", "--checkpoint.every", "2", "--comm.timeout_s", "120"]
    steps = 2 if ctx.dry else 8
    launcher = ["--nproc", str(world)] + (["--max-restarts", "1"] if world == 1 else [])
    code, text = ctx.run([*base, *launcher, "--train.steps", str(steps),
                          "--logging.eval_every", "2", "--comm.check_lockstep", "true",
                          "--logging.sample_tokens", "16", "--logging.run_dir", str(full),
                          "--logging.overwrite", "true"], 60)
    summary = _summary(full)
    ok = code == 0 and summary is not None and (full / "sample.txt").is_file()
    backend = "gloo" if ctx.dry else "NCCL"
    rep.add("cli", f"train --nproc {world} via torchrun ({backend}): ZeRO-3 bf16, eval, "
            "checkpoints, lockstep check, sample", "PASS" if ok else
            ("TIMEOUT" if code == 124 else "FAIL"),
            f"final val loss {summary.get('final_val_loss')}" if ok else
            f"exit {code}: {last_line(text)}")
    if not ok:
        return
    code, text = ctx.run([ctx.py, "-m", "zerotrain", "sample", "--checkpoint",
                          str(full / "checkpoints"), "--tokens", "8", "--prompt", "def "],
                         45)
    ok = code == 0 and "def " in text
    rep.add("cli", "zerotrain sample from the checkpoint", "PASS" if ok else "FAIL",
            ascii(last_line(text)[:60]) if ok else f"exit {code}: {last_line(text)}")


def _summary(run_dir: Path) -> dict | None:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return recs[-1] if recs and recs[-1].get("type") == "summary" else None


# ----------------------------------------------------------------------------- stages


TOL = {"fp32": 1e-4, "bf16": 5e-2}  # fp32 with TF32 off: reduction order only
LOSS_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def section_stages(ctx: Ctx) -> None:
    """Every stage at N ranks against one process: the section that puts zerotrain's
    collectives on NCCL, so only with N >= 2 GPUs (dry run: 2 CPU ranks)."""
    rep = ctx.rep
    world = 2 if ctx.dry else ctx.gpus
    if world < 2:
        for check, why in NEEDS_TWO:
            rep.add("stages", check, "UNTESTED", f"needs >= 2 GPUs: {why}")
        return
    out = ctx.work / "stages"
    out.mkdir(exist_ok=True)
    common = ["--out", str(out), "--batch-world", str(world), *_dry(ctx),
              *(["--steps", "3"] if ctx.dry else [])]
    worker = BENCH / "gpu_check_workers.py"
    code, text = ctx.ranks(1, worker, ["stages", "--reference", *common], 60)
    ref = read_json(out / "stages_ref.json")
    if not (ref and ref.get("ok")):
        failed(ctx, "stages", "one-process reference", code, text)
        return
    code, text = ctx.ranks(world, worker, ["stages", *common], WHOLE)
    res = read_json(out / "stages.json") or _rank_failure(out, "stages")
    if not (res and res.get("ok")):
        if res and res.get("error"):
            rep.add("stages", f"{world} ranks", "FAIL", res["error"])
        else:
            failed(ctx, "stages", f"{world} ranks", code, text)
        return
    import torch

    base_runs = torch.load(out / "stages_ref.pt", weights_only=False)
    runs = torch.load(out / "stages.pt", weights_only=False)
    for key, r in runs.items():
        if "error" in r:  # the N1 case reports itself
            rep.add("stages", key, r["status"], r["error"])
            continue
        prec = key.split(" | ")[1]
        b = base_runs[f"stage 0 | {prec}"]
        err = max(float((r["params"][n] - p).norm() / (p.norm() + 1e-30))
                  for n, p in b["params"].items())
        dloss = max(abs(x - y) for x, y in zip(r["losses"], b["losses"]))
        f = r["facts"]
        ok = err <= TOL[prec] and dloss <= LOSS_TOL[prec] and f.get("host_states_pinned",
                                                                    True) is not False
        rep.add("stages", f"{key.replace(' | ', ', ')} at N={world} vs one process",
                "PASS" if ok else "FAIL",
                f"rel. param error {err:.1e} (tol {TOL[prec]:g}), max |Δloss| {dloss:.1e}; "
                f"backend {f['backend']}, comm device {f['comm_device']}")


def _rank_failure(out: Path, name: str) -> dict | None:
    failed_files = sorted(out.glob(f"{name}_rank*_failed.json"))
    return read_json(failed_files[0]) if failed_files else None


# ----------------------------------------------------------------------------- perf


def section_perf(ctx: Ctx) -> None:
    """zerotrain ZeRO-3 vs FSDP2, both models built on meta (FSDP2: to_empty and the
    model's own init), so init peaks compare like for like; each system its own cap."""
    rep = ctx.rep
    world = 1 if ctx.dry else max(1, ctx.gpus)
    out = ctx.work / "perf"
    out.mkdir(exist_ok=True)
    a = ctx.args
    size = (["--preset", "gpt-tiny", "--seq", "32", "--batch", "2", "--steps", "2",
             "--warmup", "1", "--vocab", "512"] if ctx.dry else
            ["--preset", a.preset, "--seq", str(a.seq), "--batch", str(a.batch)])
    # the GPU: one process per system (its own peak and cap); the dry run: one for both
    jobs = [["zt-3,fsdp2"]] if ctx.dry else [["zt-3"], ["fsdp2"]]
    res = {}
    for i, (systems,) in enumerate(jobs):
        left = ctx.deadline - time.monotonic()
        if left < 30:
            rep.add("perf", systems, "SKIP", f"out of time ({left:.0f} s left)")
            continue
        code, text = ctx.ranks(world, BENCH / "gpu_check_workers.py",
                               ["perf", "--system", systems, "--out", str(out), *size,
                                *_dry(ctx)], left / (len(jobs) - i))
        for system in systems.split(","):
            r = read_json(out / f"perf_{system}.json") or _rank_failure(out, f"perf_{system}")
            if not (r and r.get("ok")):
                if r and r.get("error"):
                    rep.add("perf", system, "FAIL", r["error"])
                else:
                    failed(ctx, "perf", system, code, text)
                continue
            res[system] = r
            rep.add("perf", f"{system} ({r['params'] / 1e9:.3f}B params, N={r['world_size']})",
                    "INFO", f"step {r['median_step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} "
                    f"tokens/s, peak {r['peak_gib']:.2f} GiB, after init "
                    f"{r['init_peak_gib']:.2f} GiB (built on meta), init {r['init_s']:.1f} s, "
                    f"first loss {r['losses'][0]:.4f}")
    rep.data["perf"] = res
    zt, fs = res.get("zt-3"), res.get("fsdp2")
    if zt and fs and fs["median_step_s"] and fs["peak_gib"]:
        rep.add("perf", "zt-3 / fsdp2", "INFO",
                f"step time {zt['median_step_s'] / fs['median_step_s']:.2f}x, peak "
                f"{zt['peak_gib'] / fs['peak_gib']:.2f}x, init peak "
                f"{zt['init_peak_gib'] / max(fs['init_peak_gib'], 1e-9):.2f}x (<= 1: "
                f"zerotrain better); first loss Δ {abs(zt['losses'][0] - fs['losses'][0]):.1e}")


# ----------------------------------------------------------------------------- main


SECTIONS: dict[str, Callable[[Ctx], None]] = {
    "env": section_env, "setup": section_setup, "probes": section_probes,
    "fp8": section_fp8, "race": section_race, "init_mem": section_init_mem,
    "pytest": section_pytest, "cli": section_cli, "stages": section_stages,
    "perf": section_perf}
NEEDS_ZEROTRAIN = set(ORDER) - {"env", "setup"}


def _children_cpu() -> float:
    """CPU seconds of every finished child so far (the dry run's cost on shared cores)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU ranks over gloo, tiny sizes")
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or os.environ.get("OUT")
                   or str(ROOT / "bench" / "results" / "gpu_check"))
    p.add_argument("--work", help="scratch folder (default: a new one under /tmp)")
    p.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET",
                                                                        480)),
                   help="seconds for all sections (default 480)")
    p.add_argument("--sections", nargs="*", default=ORDER, choices=ORDER)
    p.add_argument("--wheels", help="a folder of wheels for what the machine lacks (offline)")
    p.add_argument("--preset", default="llama-1b", help="init_mem and perf model")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="perf: sequences per rank")
    p.add_argument("--init-ranks", type=int, default=8, help="init_mem: processes on the GPU")
    p.add_argument("--pretend-missing", nargs="*", default=[], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="zerotrain-gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rep = Report(out, args.budget, args.dry_run)
    ctx = Ctx(rep, args, work)
    rep.data.update(host=socket.gethostname(), platform=platform.platform(), work=str(work))
    caps = DRY_CAPS if args.dry_run else CAPS
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        run_sections(rep, ctx, caps)
    finally:
        rep.write()
    print("\n" + (out / "gpu_check.md").read_text() + f"\nresults: {out}; scratch: {work}")
    return 1 if any(r["status"] in ("FAIL", "TIMEOUT") for r in rep.rows) else 0


def run_sections(rep: Report, ctx: Ctx, caps: dict[str, float]) -> None:
    """env and setup always (later sections need their verdicts), then those asked for."""
    for name in [s for s in ORDER if s in ctx.args.sections or s in ("env", "setup")]:
        t0, cpu0 = time.monotonic(), _children_cpu()
        left = rep.left()
        cap = min(caps[name], left)
        n_rows = len(rep.rows)
        if name in NEEDS_ZEROTRAIN and ctx.blocked:
            rep.add(name, "section", "SKIP", f"blocked: {ctx.blocked} (see env / setup)")
        elif cap < 10:
            rep.add(name, "section", "SKIP", f"out of time budget ({left:.0f} s left)")
        else:
            ctx.deadline = t0 + cap
            try:
                SECTIONS[name](ctx)
            except Exception as e:  # one broken section must not hide the others
                rep.add(name, "section", "FAIL", f"{type(e).__name__}: {e}")
            if len(rep.rows) == n_rows:
                rep.add(name, "section", "FAIL", "reported no result")
        rep.sections[name] = {"status": rep.section_status(name), "cap_s": round(cap),
                              "seconds": round(time.monotonic() - t0, 1),
                              "cpu_s": round(_children_cpu() - cpu0, 1)}
        rep.write()  # a result file even if the caller's own limit strikes later
    if "stages" not in ctx.args.sections and ctx.gpus == 1 and not ctx.blocked:
        for check, why in NEEDS_TWO:  # the table always says what one GPU cannot test
            rep.add("stages", check, "UNTESTED", f"needs >= 2 GPUs: {why}")


if __name__ == "__main__":
    sys.exit(main())
