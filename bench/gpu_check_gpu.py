"""bench/gpu_check.py's one-GPU sections: probes (bench/gpu_verify/probes.py), review3
(bench/gpu_verify/review3_checks.py), race (Offload under delayed copies), fp8
(bench/gpu_check_fp8.py), init_mem (ZeRO-3's CUDA init peak vs its bound and N4), pytest
(-m gpu)."""

from __future__ import annotations

import shutil

from gpu_check_core import BENCH, VERIFY, WHOLE, Ctx, failed, last_line, read_json

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


# ----------------------------------------------------------------------------- review3


def section_review3(ctx: Ctx) -> None:
    """One process, one row per check it records (W-1, W-2, W-3, C-2 as REPRODUCED or
    FIXED; the tiers, the FP8 wire's 32 steps, tiles, the mask and DeepSpeed as PASS)."""
    out = ctx.work / "review3"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    code, text = ctx.run([ctx.py, str(VERIFY / "review3_checks.py"), "--out", str(out),
                          *_dry(ctx)], WHOLE)
    rows = read_json(out / "review3.json")
    for r in rows or []:
        ctx.rep.add("review3", r["check"], r["status"], r["detail"])
    if code or not rows:
        failed(ctx, "review3", "review3_checks.py", code, text)


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
    """normal and sleep in one process, compared bit for bit (the review's trim: the
    CUDA_LAUNCH_BLOCKING=1 process, ~20 s, is gone from the one-GPU call)."""
    out = ctx.work / "race"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = [ctx.py, str(VERIFY / "offload_race.py"), "--out-dir", str(out), *_dry(ctx),
              *(["--steps", "3"] if ctx.dry else [])]
    code, text = ctx.run([*script, "--runs", "normal", "sleep", "--compare"], WHOLE)
    rows = read_json(out / "race.json")
    if not rows:
        failed(ctx, "race", "runs and compare", code, text)
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


GPU_TESTS = ["tests/test_gpu.py", "tests/test_fp8.py", "tests/test_gpu_review2.py"]


def section_pytest(ctx: Ctx) -> None:
    what = "pytest -m gpu " + " ".join(GPU_TESTS)
    code, text = ctx.run([ctx.py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *GPU_TESTS], WHOLE)
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
                    "emulation, N1 with CUDA shards, N9's registered buffers",
                    "PASS" if code == 0 else "FAIL", tail)
