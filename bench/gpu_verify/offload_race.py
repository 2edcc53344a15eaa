"""Offload's fences under delayed copies (W1, S2, S6): bench/gpu_check.sh, section race.

Trains the same tiny GPT under four Offload/ZeRO-3 configurations (Muon + Offload among
them) and saves every run's losses and final parameters:
  normal    as shipped;
  sleep     a ~10 ms GPU sleep queued right before each async copy (the publish H2D on
            the current stream, the gradient D2H on Offload's side stream, the batch H2D),
            so each copy lands long after the host moved on: a missing fence (event,
            record_stream, pinned-block reuse) then reads or writes stale data;
  blocking  normal once more, in a process with CUDA_LAUNCH_BLOCKING=1 (copies synchronous;
            the dry run's, no longer the one-GPU call's: it cost ~20 s).
With deterministic kernels they agree bit for bit:
  python offload_race.py --out-dir D --runs normal sleep
  CUDA_LAUNCH_BLOCKING=1 python offload_race.py --out-dir D --runs blocking --compare
writes D/race.json and exits 1 on any difference. `--dry-run`: the same on the CPU, where
copies are synchronous and the sleeps pass straight through (a test of this script only).
Needs PYTHONPATH=<repo>/src:<repo>/tests and CUBLAS_WORKSPACE_CONFIG=:4096:8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms at H200 clocks
CASES = {
    "zero2-offload-bf16": {"zero": {"stage": 2, "offload_optimizer": "cpu"}},
    "zero3-offload-bf16-accum2": {"zero": {"stage": 3, "offload_optimizer": "cpu"},
                                  "data": {"grad_accum_steps": 2}},
    "zero3-bf16": {"zero": {"stage": 3}},
    # N7's second half: the fence before a Muon master slice is rewritten
    "zero3-offload-muon-bf16": {"zero": {"stage": 3, "offload_optimizer": "cpu"},
                                "optimizer": {"name": "muon"}},
}


def patch_sleeps() -> None:
    """Queue a GPU sleep before every async copy that a fence must order."""
    from zerotrain.data import sampler
    from zerotrain.zero.states import host as offload

    real_write = offload.HostOffload.write_master

    def write(self, u, dst):
        if self.gpu:
            torch.cuda._sleep(SLEEP_CYCLES)  # the publish H2D queues behind this
        return real_write(self, u, dst)

    real_landing = offload.HostGrads.landing

    def landing(self, u):
        out, done = real_landing(self, u)
        if not self.gpu:
            return out, done

        def late_done():
            with torch.cuda.stream(self.stream):  # the D2H copy queues behind this
                torch.cuda._sleep(SLEEP_CYCLES)
            done()

        return out, late_done

    real_to_device = sampler.to_device

    def to_device(t, device):
        if device.type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)  # the pinned staging block stays in use
        return real_to_device(t, device)

    offload.HostOffload.write_master = write
    offload.HostGrads.landing = landing
    sampler.to_device = to_device


def run_case(over: dict, device: str, steps: int) -> dict:
    from zerotrain.config import deep_merge
    from zerotrain.data import sampler
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import batches, full_params, make_config

    over = deep_merge(over, {"precision": {"dtype": "bf16"}, "train": {"device": device},
                             "zero": {"bucket_mb": 0.01}, "optimizer": {"lr": 2e-3}})
    cfg = make_config(over, 1, steps)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg)
    accum, b = cfg.data.grad_accum_steps, cfg.data.micro_batch_size
    losses = []
    for X, Y in batches(steps):
        for m in range(accum):
            x, y = X[m * b:(m + 1) * b], Y[m * b:(m + 1) * b]
            loss = eng(sampler.to_device(x, eng.device), sampler.to_device(y, eng.device))
            eng.backward(loss)
            eng.step()
            losses.append(loss.detach())
    s = eng.strategy
    facts = {"step_by_unit": type(s.updater).__name__ == "UnitByUnit", "units": len(s.units),
             "pinned": all(u.master.is_pinned() for u in s.units)
             if s.offload and device == "cuda" else None}
    out = {"losses": [float(v) for v in losses],
           "params": {k: v.cpu() for k, v in full_params(eng).items()}, "facts": facts}
    eng.close()
    return out


def compare(out: str, runs: list[str]) -> int:
    """Every run against the first, bit for bit; one JSON row per (run, case)."""
    loaded = {name: torch.load(path, weights_only=False)
              for name, path in (r.split("=", 1) for r in runs)}
    base_name, base = next(iter(loaded.items()))
    rows, bad = [], 0
    for name, res in loaded.items():
        for case, r in res.items():
            b = base[case]
            same_loss = r["losses"] == b["losses"]
            diff = max(float((r["params"][k].float() - b["params"][k].float()).abs().max())
                       for k in b["params"])
            facts = r["facts"]
            offload = "offload" in case
            fenced = not offload or facts["pinned"] in (True, None)
            ok = same_loss and diff == 0.0 and fenced
            bad += not ok
            rows.append({"run": name, "case": case, "vs": base_name, "identical": ok,
                         "losses_identical": same_loss, "max_param_diff": diff,
                         "facts": facts})
            print(f"[race] {'PASS' if ok else 'FAIL'} {name} {case}: losses identical "
                  f"{same_loss}, max |param diff| {diff:.3g}, {facts}", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True, help="<run>.pt per run; race.json")
    p.add_argument("--runs", nargs="*", default=[], choices=["normal", "sleep", "blocking"],
                   help="in this order; sleep patches for the rest of the process; "
                   "blocking is normal, named for the caller's CUDA_LAUNCH_BLOCKING=1")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--compare", action="store_true", help="then every <run>.pt in --out-dir "
                   "against normal.pt, bit for bit (exit 1 on a difference)")
    a = p.parse_args()
    out = Path(a.out_dir)
    device = "cpu" if a.dry_run else "cuda"
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":  # math attention: a deterministic backward
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    dry = ("zero3-offload-bf16-accum2", "zero3-offload-muon-bf16")  # the script's test
    cases = {k: v for k, v in CASES.items() if k in dry} if a.dry_run else CASES
    for run in a.runs:
        if run == "sleep":  # on the CPU the wrappers pass straight through
            patch_sleeps()
        torch.save({name: run_case(over, device, a.steps) for name, over in cases.items()},
                   out / f"{run}.pt")
    if not a.compare:
        return 0
    runs = [f"{r}={out / f'{r}.pt'}" for r in ("normal", "sleep", "blocking")
            if (out / f"{r}.pt").is_file()]
    return compare(str(out / "race.json"), runs)


if __name__ == "__main__":
    sys.exit(main())
