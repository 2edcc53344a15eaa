"""bench/gpu_check.py's training sections: cli (train and sample through the
launcher), stages (every stage at N GPUs against one process; one GPU: what it cannot
test), perf (zerotrain ZeRO-3 vs FSDP2, bench/gpu_check_workers.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_check_core import (
    BENCH,
    NEEDS_TWO,
    ROOT,
    WHOLE,
    Ctx,
    failed,
    last_line,
    read_json,
)
from gpu_check_gpu import _dry

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
                          "--logging.overwrite", "true"],
                         WHOLE if ctx.dry else 60)  # the dry run: 2 shared cores, slow
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
    code, text = ctx.ranks(1, worker, ["stages", "--reference", *common],
                           WHOLE if ctx.dry else 60)
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
