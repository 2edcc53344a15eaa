"""The GPU check (issues 13 and 18): what only a CUDA machine can show, on whatever GPUs
it has, in under 8 minutes. Run through `bash bench/gpu_check.sh` (which first runs
`pytest -m gpu`); `--dry-run` runs the same sections on CPU ranks to test this script.

Sections (each a subprocess with its own time limit; the whole run keeps to --budget):
  env     torch, CUDA, NCCL, the GPUs, FP8 support
  stages  every ZeRO stage and Offload at the world size (all GPUs, NCCL; with one GPU,
          world size 1), fp32 (TF32 off) and bf16, against one process (stage 0)
  cli     `zerotrain train` (ZeRO-3, bf16, eval, checkpoint, sample), resume, `sample`,
          and with several GPUs: --nproc above the GPU count is one error
  perf    zerotrain ZeRO-3 vs FSDP2 (fully_shard, reshard after forward) on a 1-3B
          model: step time and peak torch.cuda.max_memory_allocated; perf2 (last, if
          time is left): ZeRO-2 vs FSDP2 without resharding
  fp8     the FP8 path through torch._scaled_mm (zerotrain.numerics.fp8), where the GPU
          has FP8 matmul; skipped, saying why, otherwise
Writes <out>/gpu_check.md and <out>/gpu_check.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "bench" / "gpu_check_workers.py"
# fp32 with TF32 off: only the order of reductions differs (cuBLAS split-K, NCCL,
# embedding-backward atomics); bf16: parameters rounded to 8 bits every step
TOL = {"fp32": 1e-4, "bf16": 5e-2}
LOSS_TOL = {"fp32": 1e-4, "bf16": 2e-2}  # max |Δ loss| over the steps


class Report:
    def __init__(self, out: Path, budget: float):
        self.out, self.rows, self.data = out, [], {}
        self.deadline = time.monotonic() + budget
        self.log = out / "gpu_check.log"  # every command and its whole output
        self.log.write_text("")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, section: str, check: str, status: str, detail: str = "") -> None:
        self.rows.append({"section": section, "check": check, "status": status,
                          "detail": detail})
        print(f"[gpu_check] {section:7} {status:5} {check}: {detail}", flush=True)

    def table(self) -> str:
        lines = ["| section | check | result | detail |", "|---|---|---|---|"]
        def cell(x: str) -> str:
            return str(x).replace("|", "\\|")

        lines += [f"| {r['section']} | {cell(r['check'])} | {r['status']} | "
                  f"{cell(r['detail'])} |" for r in self.rows]
        return "\n".join(lines)

    def write(self) -> None:
        env = self.data.get("env", {})
        head = (f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}\n\n"
                f"{env.get('gpus_text', 'no GPU')}; torch {env.get('torch')}, CUDA "
                f"{env.get('cuda')}, NCCL {env.get('nccl')}; world size "
                f"{env.get('world')}\n\n")
        (self.out / "gpu_check.md").write_text(head + self.table() + "\n")
        (self.out / "gpu_check.json").write_text(
            json.dumps({"rows": self.rows, **self.data}, indent=1, default=str))


# ----------------------------------------------------------------------------- env


def environment(dry: bool) -> dict:
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] \
        if cuda else []
    cap = torch.cuda.get_device_capability(0) if gpus else None
    nccl = None
    if cuda:
        try:  # a tuple on recent torch, an int on old ones
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # no NCCL in this build: the stages section will say more
            nccl = f"unknown ({type(e).__name__})"
    fp8_module = _has_module("zerotrain.numerics.fp8_linear")
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "python": platform.python_version(), "gpus": [g.name for g in gpus],
            "gpu_mem_gib": [round(g.total_memory / 2**30, 1) for g in gpus],
            "capability": cap, "dry_run": dry,
            "world": 2 if dry else max(1, len(gpus)),
            "fp8_matmul": bool(cap and cap >= (8, 9) and hasattr(torch, "_scaled_mm")),
            "zerotrain_fp8": fp8_module,
            "gpus_text": (f"{len(gpus)} x {gpus[0].name} "
                          f"({gpus[0].total_memory / 2**30:.0f} GiB, sm_{cap[0]}{cap[1]})"
                          if gpus else "no GPU (dry run on CPU ranks)")}


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# ----------------------------------------------------------------------------- helpers


def run(cmd: list[str], limit: float, log: Path) -> tuple[int, str]:
    """Run `cmd` (cwd: the repository) for at most `limit` s; (exit code, output tail)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                           env=env)
        code, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code = 124
        text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                else (e.stdout or "")) + f"\n[timed out after {limit:.0f} s]"
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{text}\n")
    return code, text[-1500:]


def torchrun(world: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", str(WORKERS), *args]


def job_result(out: Path, name: str, code: int, tail: str) -> dict:
    f = out / f"{name}.json"
    failed = sorted(out.glob(f"{name}_rank*_failed.json"))
    if failed:
        return json.loads(failed[0].read_text())
    if f.is_file():
        return json.loads(f.read_text())
    return {"ok": False, "error": f"exit code {code}: {tail.strip().splitlines()[-1:]}"}


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""


# ----------------------------------------------------------------------------- stages


def section_stages(rep: Report, args: argparse.Namespace, world: int) -> None:
    dry = ["--dry-run"] if args.dry_run else []
    limit = min(240.0, rep.left())
    common = ["--out", str(rep.out), "--batch-world", str(world), *dry]
    code, tail = run(torchrun(1, ["stages", "--reference", *common]), limit / 3, rep.log)
    ref_res = job_result(rep.out, "stages_ref", code, tail)
    code, tail = run(torchrun(world, ["stages", *common]), rep.left() - 5, rep.log)
    res = job_result(rep.out, "stages", code, tail)
    for what, r in (("one process (reference)", ref_res), (f"{world} rank(s)", res)):
        if not r.get("ok"):
            rep.add("stages", what, "FAIL", r.get("error", "?"))
            return
    ref = torch.load(rep.out / "stages_ref.pt", weights_only=False)
    runs = torch.load(rep.out / "stages.pt", weights_only=False)
    rep.data["stages"] = {}
    for key, r in runs.items():
        prec = key.split(" | ")[1]
        base = ref[f"stage 0 | {prec}"]
        err = max(float((r["params"][n] - p).norm() / (p.norm() + 1e-30))
                  for n, p in base["params"].items())
        dloss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        f = r["facts"]
        ok = err <= TOL[prec] and dloss <= LOSS_TOL[prec] and all(map(_finite, r["losses"]))
        if f.get("host_states_pinned") is False:
            ok = False
        detail = (f"rel. param error {err:.1e} (tol {TOL[prec]:g}), max |Δloss| {dloss:.1e} "
                  f"(tol {LOSS_TOL[prec]:g}), "
                  f"{r['seconds']:.1f} s; comm device {f['comm_device']}, backend "
                  f"{f['backend']}, comm thread {f['comm_thread']}"
                  + (f", host states pinned {f['host_states_pinned']}"
                     if "host_states_pinned" in f else "")
                  + (f", peak {f['peak_mib']:.0f} MiB" if "peak_mib" in f else ""))
        what = key.replace(" | ", ", ")
        rep.add("stages", f"{what} at N={world} vs one process", "PASS" if ok else "FAIL", detail)
        rep.data["stages"][key] = {"rel_param_error": err, "max_dloss": dloss, **f,
                                   "losses": r["losses"]}


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


# ----------------------------------------------------------------------------- cli


def section_cli(rep: Report, args: argparse.Namespace, world: int) -> None:
    text = ROOT / "README.md"
    dev = "cpu" if args.dry_run else "cuda"
    base = [sys.executable, "-m", "zerotrain", "train", "--model.n_layer", "2",
            "--model.n_embd", "64", "--model.n_head", "2", "--model.block_size", "64",
            "--data.path", str(text), "--data.micro_batch_size", "4",
            "--schedule.kind", "constant", "--schedule.warmup_steps", "0",
            "--precision.dtype", "bf16", "--zero.stage", "3", "--train.device", dev,
            "--logging.progress", "false", "--logging.plot", "false",
            "--logging.eval_every", "4", "--checkpoint.every", "4",
            "--comm.timeout_s", "120", "--nproc", str(world)]
    full, part = rep.out / "cli_full", rep.out / "cli_part"
    t0 = time.perf_counter()
    code, tail = run([*base, "--train.steps", "8", "--logging.sample_tokens", "32",
                      "--logging.run_dir", str(full), "--logging.overwrite", "true"],
                     min(150, rep.left()), rep.log)
    summary = _summary(full)
    ok = code == 0 and summary is not None and (full / "sample.txt").is_file()
    rep.add("cli", f"train ZeRO-3 bf16 --nproc {world} (eval, checkpoints, sample)",
            "PASS" if ok else "FAIL",
            f"{time.perf_counter() - t0:.0f} s, final val loss "
            f"{summary['final_val_loss']:.4f}" if ok else last_line(tail))
    if not ok:
        return
    code1, tail1 = run([*base, "--train.steps", "4", "--logging.sample_tokens", "0",
                        "--logging.run_dir", str(part), "--logging.overwrite", "true"],
                       min(120, rep.left()), rep.log)
    code2, tail2 = run([*base, "--train.steps", "8", "--logging.sample_tokens", "0",
                        "--logging.run_dir", str(part), "--resume"], min(120, rep.left()),
                       rep.log)
    resumed = _summary(part)
    if code1 or code2 or resumed is None:
        rep.add("cli", "resume 4 -> 8 steps", "FAIL", last_line(tail2 if code1 == 0 else tail1))
    else:
        d = abs(resumed["final_train_loss"] - summary["final_train_loss"])
        rep.add("cli", "resume 4 -> 8 steps equals 8 uninterrupted steps",
                "PASS" if d <= 2e-2 else "FAIL", f"|Δ final train loss| {d:.1e} (tol 2e-2, "
                "bf16; CUDA kernels are not bit-reproducible)")
    code, tail = run([sys.executable, "-m", "zerotrain", "sample", "--checkpoint",
                      str(full / "checkpoints"), "--tokens", "16", "--prompt", "def "],
                     min(90, rep.left()), rep.log)
    rep.add("cli", "zerotrain sample (consolidated checkpoint)",
            "PASS" if code == 0 and tail.lstrip().startswith("def ") else "FAIL",
            last_line(tail)[:80].encode("ascii", "replace").decode())
    if world > 1 and not args.dry_run:
        code, tail = run([*base, "--nproc", str(world + 1), "--train.steps", "2"],
                         min(60, rep.left()), rep.log)
        ok = code != 0 and "visible GPU" in tail
        rep.add("cli", f"--nproc {world + 1} on {world} GPUs is one error",
                "PASS" if ok else "FAIL", last_line(tail))


def _summary(run_dir: Path) -> dict | None:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return recs[-1] if recs and recs[-1].get("type") == "summary" else None


# ----------------------------------------------------------------------------- perf


PERF_PAIRS = {"perf": ("zt-3", "fsdp2"), "perf2": ("zt-2", "fsdp2-noreshard")}


def section_perf(rep: Report, args: argparse.Namespace, world: int, pair: str) -> None:
    systems = PERF_PAIRS[pair]
    size = (["--preset", "gpt-tiny", "--seq", "64", "--batch", "2"] if args.dry_run else
            ["--preset", args.preset, "--seq", str(args.seq), "--batch", str(args.batch)])
    p = rep.data.setdefault("perf", {})
    for system in systems:
        if rep.left() < 75:
            rep.add("perf", system, "SKIP", "out of time budget")
            continue
        code, tail = run(torchrun(world, ["perf", "--system", system, "--out", str(rep.out),
                                          *size, *(["--dry-run"] if args.dry_run else [])]),
                         min(180, rep.left() - 10), rep.log)
        r = job_result(rep.out, f"perf_{system}", code, tail)
        p[system] = r
        if not r.get("ok"):
            rep.add("perf", system, "FAIL", r.get("error", "?"))
            continue
        rep.add("perf", f"{system} ({r['params'] / 1e9:.2f}B params, N={r['world_size']})",
                "INFO", f"step {r['median_step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} "
                f"tokens/s, peak {r['peak_gib']:.2f} GiB (after init {r['init_peak_gib']:.2f}),"
                f" init {r['init_s']:.0f} s, first loss {r['losses'][0]:.4f}")
    zt, peer = systems
    a, b = p.get(zt, {}), p.get(peer, {})
    if a.get("ok") and b.get("ok") and b["median_step_s"] and b["peak_gib"]:
        rep.add("perf", f"{zt} / {peer}", "INFO",
                f"step time {a['median_step_s'] / b['median_step_s']:.2f}x, peak memory "
                f"{a['peak_gib'] / b['peak_gib']:.2f}x (<= 1: zerotrain better); first "
                f"loss Δ {abs(a['losses'][0] - b['losses'][0]):.1e}")


# ----------------------------------------------------------------------------- fp8


def section_fp8(rep: Report, args: argparse.Namespace, env: dict) -> None:
    if not env["zerotrain_fp8"]:
        rep.add("fp8", "FP8 path", "SKIP", "zerotrain.numerics.fp8 is not in this tree")
        return
    if not (env["fp8_matmul"] or args.dry_run):
        rep.add("fp8", "FP8 path", "SKIP", f"GPU capability {env['capability']}: no FP8 "
                "matmul (needs sm_89+ and torch._scaled_mm)")
        return
    code, tail = run([sys.executable, str(ROOT / "bench" / "gpu_check_fp8.py"), "--out",
                      str(rep.out), *(["--dry-run"] if args.dry_run else [])],
                     min(120, rep.left()), rep.log)
    r = job_result(rep.out, "fp8", code, tail)
    rep.data["fp8"] = r
    if not r.get("ok"):
        rep.add("fp8", "FP8 path", "FAIL", r.get("error", "?"))
        return
    for row in r["rows"]:
        rep.add("fp8", row["check"], row["status"], row["detail"])


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "bench/results/gpu_check"))
    p.add_argument("--dry-run", action="store_true", help="CPU ranks over gloo, tiny sizes")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all sections")
    p.add_argument("--preset", default="llama-1b", help="perf: model preset (1-3B)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="perf: sequences per rank")
    p.add_argument("--sections", nargs="*", default=["stages", "cli", "perf", "fp8", "perf2"],
                   help="perf: ZeRO-3 vs FSDP2 (reshard); perf2: ZeRO-2 vs FSDP2 (no reshard)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    rep = Report(out, args.budget)
    env = environment(args.dry_run)
    rep.data["env"] = env
    if not env["gpus"] and not args.dry_run:
        rep.add("env", "CUDA", "FAIL", "no CUDA device visible to this torch "
                f"({torch.__version__}); nothing to check (--dry-run tests the script)")
        rep.write()
        print(rep.table())
        return 1
    rep.add("env", "devices", "INFO", env["gpus_text"])
    world = env["world"]
    sections = {"stages": lambda: section_stages(rep, args, world),
                "cli": lambda: section_cli(rep, args, world),
                "perf": lambda: section_perf(rep, args, world, "perf"),
                "perf2": lambda: section_perf(rep, args, world, "perf2"),
                "fp8": lambda: section_fp8(rep, args, env)}
    for name in args.sections:
        if rep.left() < 20:
            rep.add(name, "all", "SKIP", "out of time budget")
            continue
        try:
            sections[name]()
        except Exception as e:  # one broken section must not hide the others' results
            rep.add(name, "section", "FAIL", f"{type(e).__name__}: {e}")
    rep.write()
    print("\n" + rep.table() + f"\n\nwritten: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "FAIL" for r in rep.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
