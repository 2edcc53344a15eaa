"""ZeRO-3's CUDA init peak per rank at N ranks on ONE GPU (C4, N4): bench/gpu_check.sh,
section init_mem.

    OMP_NUM_THREADS=2 torchrun --standalone --nproc-per-node 8 \
        bench/gpu_verify/init_mem.py --preset llama-1b --out DIR

NCCL refuses two ranks on one GPU, but ZeRO-3's initialisation runs no collective on the
data: N processes open a gloo group (for rank and world size only) and each builds the
Engine with its states on cuda:0. Each rank's torch.cuda.max_memory_allocated during init
is held against
    bound = shards (bf16) + fp32 masters + fp32 grad shards + widest parameter (the init
            scratch) + largest unit (its transient full buffer, N4) + 64 MiB
and reported next to the estimator's prediction of the init phase and the behaviour before
the C4 fix (the whole fp32 model plus a bf16 flat copy on every GPU).
Rank 0 writes DIR/init_mem.json. `--dry-run`: CPU ranks (no peak measured: logic only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")  # the caller's own group: the Engine uses it as is
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    from zerotrain.config import build_config
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    cfg = build_config({"model": {"preset": a.preset, "vocab_size": a.vocab, "block_size": 256},
                        "precision": {"dtype": "bf16"}, "zero": {"stage": 3},
                        "train": {"device": dev.type}})
    model = build_model(cfg.model, device="meta")
    n_params = sum(q.numel() for q in model.parameters())
    widest = max(q.numel() for q in model.parameters())
    base = 0
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    eng = Engine(model, cfg, dev)
    init_s = time.perf_counter() - t0
    s = eng.strategy
    shard_numel = sum(u.shard_numel for u in s.units)
    largest_unit = max(u.padded_numel for u in s.units)
    bound = shard_numel * (2 + 4 + 4) + widest * 2 + largest_unit * 2 + (64 << 20)
    old = n_params * (4 + 2)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    predicted = eng.memory_phases().get("predicted", {}).get("init", 0)
    res = {"rank": rank, "world": world, "params": n_params, "init_s": round(init_s, 2),
           "peak_mib": peak / 2**20, "bound_mib": bound / 2**20, "old_mib": old / 2**20,
           "phase_init_mib": (eng.phases.peaks.get("init", 0) - eng.phases.baseline) / 2**20,
           "predicted_init_mib": predicted / 2**20,
           "ok": dev.type != "cuda" or peak <= bound}
    eng.close()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        Path(a.out, "init_mem.json").write_text(json.dumps(
            {"ok": all(r["ok"] for r in everyone), "measured": dev.type == "cuda",
             "ranks": everyone}, indent=1))
        for r in everyone:
            print(f"[init_mem] {'PASS' if r['ok'] else 'FAIL'} rank {r['rank']}/{r['world']}: "
                  f"peak {r['peak_mib']:.0f} MiB, bound {r['bound_mib']:.0f} MiB, predicted "
                  f"{r['predicted_init_mib']:.0f} MiB, before C4 {r['old_mib']:.0f} MiB; "
                  f"{r['init_s']} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
