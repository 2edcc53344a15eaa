"""The one-call GPU check (issue 21; the fourth GPU review's section 5): run it through
`bash bench/gpu_check.sh` (docs/gpu-check.md). On one H200 it keeps to --budget (450 s
by default): each section is a subprocess group with its own time cap, and the caps of
the sections asked for add up to the budget (scaled down together when more are asked
for); a hang kills that section only, then the next starts; a failure never stops the
run. `--dry-run` runs the sections on the CPU (gloo ranks, tiny sizes, stand-ins named in
each row) to test this script.

Sections, in order; the default (one GPU) runs env … pytest, `--sections` adds the rest:
  env       nvidia-smi, torch / CUDA / NCCL versions, capability
  setup     zerotrain's needs (pyproject.toml) and pytest; if missing, a venv with them
            (pip -c constraints.txt; offline: from --wheels) and the project installed
  probes    over one NCCL rank: C1, H1 API, S3, FP8 _scaled_mm contract and recipes, N1,
            C2, N2, N9 (bench/gpu_verify/probes.py)
  review3   the code added since the kit was written (bench/gpu_verify/review3_checks.py):
            activation offload (W-2, W-3), the FP8 wire (W-1; 32 steps vs plain FP8),
            FP8 gather + a parameter tier (C-2), the ZeRO-Infinity tiers, tiles and the
            document mask at T = 8192, the DeepSpeed drop-in
  race      Offload under delayed copies: normal vs GPU sleeps before every async copy,
            bit for bit (bench/gpu_verify/offload_race.py)
  fp8       bench/gpu_check_fp8.py: path, 8192^2 fwd+bwd speed and error, GPT bf16 vs FP8
  init_mem  ZeRO-3's CUDA init peak, 8 processes on the one GPU over gloo, vs its bound
            and the estimator's prediction (N4) (bench/gpu_verify/init_mem.py)
  pytest    pytest -m gpu tests/test_gpu.py tests/test_fp8.py tests/test_gpu_review2.py
  cli       zerotrain train through the launcher (torchrun, NCCL) and sample from its
            checkpoint
  stages    every stage at N GPUs against one process (N >= 2; one GPU: what it cannot test)
  perf      zerotrain ZeRO-3 vs FSDP2, both built on meta (bench/gpu_check_workers.py)
The code: this driver (options, the section loop), bench/gpu_check_core.py (report, caps,
commands with time caps), and the sections in bench/gpu_check_setup.py (env, setup),
bench/gpu_check_gpu.py (probes, review3, race, fp8, init_mem, pytest) and bench/gpu_check_runs.py
(cli, stages, perf).
Multi-rank jobs are started by this driver with the variables torchrun sets (one process
less per job); the cli section goes through zerotrain's own launcher (torchrun).
Results in --out: gpu_check.md (table), gpu_check.json, gpu_check.log (every command's
output). Scratch (run folders, saved tensors) in --work.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sections beside it

from gpu_check_core import (
    BUDGET,
    CAPS,
    DRY_BUDGET,
    DRY_CAPS,
    NEEDS_TWO,
    ONE_GPU,
    ORDER,
    ROOT,
    STATUSES,  # noqa: F401 (tests read it here)
    Ctx,
    Report,
    _stop,
    fit_caps,
)
from gpu_check_gpu import (
    section_fp8,
    section_init_mem,
    section_probes,
    section_pytest,
    section_race,
    section_review3,
)
from gpu_check_runs import section_cli, section_perf, section_stages
from gpu_check_setup import section_env, section_setup

# ----------------------------------------------------------------------------- main


SECTIONS: dict[str, Callable[[Ctx], None]] = {
    "env": section_env, "setup": section_setup, "probes": section_probes,
    "review3": section_review3, "fp8": section_fp8, "race": section_race,
    "init_mem": section_init_mem,
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
    p.add_argument("--budget", type=float, default=os.environ.get("GPU_CHECK_BUDGET"),
                   help=f"seconds for all sections (default {BUDGET:.0f}; with --dry-run "
                   f"{DRY_BUDGET:.0f}: 2 shared cores can be slow)")
    p.add_argument("--sections", nargs="*", default=ONE_GPU, choices=ORDER,
                   help="default: the one-GPU call (" + " ".join(ONE_GPU) + ")")
    p.add_argument("--wheels", help="a folder of wheels for what the machine lacks (offline)")
    p.add_argument("--preset", default="llama-1b", help="init_mem and perf model")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="perf: sequences per rank")
    p.add_argument("--init-ranks", type=int, default=8, help="init_mem: processes on the GPU")
    p.add_argument("--pretend-missing", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.budget = float(args.budget or (DRY_BUDGET if args.dry_run else BUDGET))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="zerotrain-gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rep = Report(out, args.budget, args.dry_run)
    ctx = Ctx(rep, args, work)
    rep.data.update(host=socket.gethostname(), platform=platform.platform(), work=str(work))
    running = [s for s in ORDER if s in args.sections or s in ("env", "setup")]
    caps = DRY_CAPS if args.dry_run else fit_caps(CAPS, running, args.budget)
    rep.data["plan"] = {s: round(caps[s]) for s in running}
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
