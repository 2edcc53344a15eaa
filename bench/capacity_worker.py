"""One rank of one bench/capacity.py run: build a system, train a few steps, report memory.

Started by bench/capacity.py (never by hand: the driver sets RANK, WORLD_SIZE and
MASTER_ADDR/PORT, and watches this process's resident memory from outside). The systems
are bench/peers_workers.py's jobs, unchanged: zerotrain's engine, PyTorch DDP, FSDP2,
DeepSpeed. zerotrain gets its model on the meta device, as `zerotrain train` builds it
(the engine materialises it unit by unit); the peers get the model built eagerly under
the same seed — the same initial weights — as bench/peers.py gives them. The one extra
system, `fsdp2-reshard-meta`, is FSDP2's own large-model recipe (fully_shard on the meta
device, then `to_empty` and initialise): it shows FSDP2's best possible init peak.

Memory is the resident set (VmRSS / VmHWM from /proc/self/status, bytes): everything
the process holds, the torch runtime included. Rank 0 writes one JSON object to --out;
every rank writes its current phase to `<out>.rank<r>.phase`, so a run stopped by the
driver's memory watchdog says where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_workers import adamw_kwargs, build_job, decay_groups, run_rank, torch_job
from zerotrain.config import ModelConfig
from zerotrain.memory import activation_bytes, proc_status, reset_peak_rss
from zerotrain.models import build_model

#: capacity-only system -> the peers job it adapts (the tier rows: zt-3 with the tiers'
#: config, which bench/capacity.py passes in --zt-config)
EXTRA = {"fsdp2-reshard-meta": "fsdp2-reshard", "zt-3-nvme": "zt-3-auto",
         "zt-3-pcpu": "zt-3-auto"}


class Phase:
    """This rank's current phase, in a file the driver reads when it stops the run."""

    def __init__(self, out: str, rank: int):
        self.path = Path(f"{out}.rank{rank}.phase")

    def __call__(self, name: str) -> None:
        self.path.write_text(name)


def hwm() -> int:
    return proc_status().get("VmHWM", 0)


def peers_namespace(a: argparse.Namespace, system: str) -> argparse.Namespace:
    """The arguments bench/peers_workers.py's job builders read."""
    return argparse.Namespace(
        system=system, model=a.model, micro_batch=a.micro_batch, steps=a.steps, warmup=0,
        lr=1e-3, weight_decay=0.1, seed=a.seed, peer_adamw=a.peer_adamw,
        zt_config=a.zt_config, ds_bucket_mb=a.ds_bucket_mb)


def fsdp2_meta_job(ns: argparse.Namespace, model: torch.nn.Module) -> Any:
    """FSDP2 from the meta device: shard first, then allocate only the local shards and
    initialise them (each parameter's full value is made once and cut; the GPT's values
    depend on (seed, name) only, so they equal the eager model's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = torch.empty(p.shape)
            model.init_param(name, full)
            p.to_local().copy_(distribute_tensor(full, mesh, p.placements).to_local())
            del full
        for b in model.buffers():
            b.zero_()
    opt = torch.optim.AdamW(decay_groups(list(model.parameters()), ns.weight_decay),
                            **adamw_kwargs(ns))
    return torch_job(model, model, opt, {"init": "meta", "reshard": True})


def build(a: argparse.Namespace, phase: Phase) -> tuple[Any, dict[str, Any]]:
    """The system's job, and what its construction cost: RSS before the model existed
    (the baseline: torch, the process group, the data) and the peak by the end of init."""
    meta = a.system.startswith("zt-") or a.system in EXTRA
    cfg = ModelConfig(**json.loads(a.model))
    base = proc_status()["VmRSS"]
    reset_peak_rss()  # the init peak is the construction's own, not the imports'
    phase("init")
    torch.manual_seed(a.seed)  # same initial weights in every system, on every rank
    model = build_model(cfg, device="meta" if meta else None)
    ns = peers_namespace(a, EXTRA.get(a.system, a.system))
    meta_job = a.system == "fsdp2-reshard-meta"
    job = fsdp2_meta_job(ns, model) if meta_job else build_job(ns, model)
    info: dict[str, Any] = {"base_rss": base, "init_peak": hwm(), "after_init_rss":
                            proc_status()["VmRSS"]}
    if a.system.startswith("zt-"):  # the engine measured its own init phase from its start
        info["engine_init_peak"] = job.engine.phases.peaks.get("init", 0)
    return job, info


def train(a: argparse.Namespace, job: Any, phase: Phase
          ) -> tuple[list[float], list[float], list[dict]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(a.seed)
    T = json.loads(a.model).get("block_size", 128)
    data = torch.randint(0, 256, (a.steps, world * a.micro_batch, T + 1), generator=g)
    lo, hi = rank * a.micro_batch, (rank + 1) * a.micro_batch
    times, losses, tiers = [], [], []
    eng = getattr(job, "engine", None)
    for i in range(a.steps):
        phase(f"step {i + 1}")
        x, y = data[i, lo:hi, :-1], data[i, lo:hi, 1:]
        t0 = time.perf_counter()
        loss = job.train_step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        # ZeRO-Infinity: each tier's bytes read and written in this step
        tiers.append(dict(getattr(eng, "last_tier_bytes", {}) or {}))
    return times, losses, tiers


def zerotrain_memory(a: argparse.Namespace, job: Any) -> dict[str, Any]:
    """The engine's measured phase peaks, and the config it ran (bench/capacity_report.py
    asks `zerotrain estimate`'s own function what it predicts for that config)."""
    eng = job.engine
    cfg = ModelConfig(**json.loads(a.model))
    act = activation_bytes(cfg, a.micro_batch, cfg.block_size, act_bytes=4)
    s = eng.strategy
    return {"engine_phases": eng.memory_phases(activations=act),
            "phase_baseline": eng.phases.baseline, "phase_peaks": dict(eng.phases.peaks),
            "config": eng.config.model_dump(mode="json"), "stage": s.stage,
            "offload": s.offload, "buffer_numels": s.buffer_numels(), "units": len(s.units)}


def run(a: argparse.Namespace, phase: Phase) -> dict[str, Any]:
    world = dist.get_world_size()
    torch.set_num_threads(1)
    job, info = build(a, phase)
    times, losses, tiers = train(a, job, phase)
    phase("report")
    mine = {**info, "final_hwm": hwm(), "times": times, "tier_bytes": tiers}
    if a.system.startswith("zt-"):
        mine["zerotrain"] = zerotrain_memory(a, job)
    # The overall peak: the engine resets the high-water mark per phase, so take the
    # largest of everything this rank saw (the driver adds its own samples).
    peaks = [info["init_peak"], mine["final_hwm"], info.get("engine_init_peak", 0)]
    peaks += list(mine.get("zerotrain", {}).get("phase_peaks", {}).values())
    mine["peak"] = max(peaks)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    job.close()
    step_times = [max(r["times"][i] for r in every) for i in range(a.steps)]
    return {"ok": True, "system": a.system, "world_size": world, "losses": losses,
            "step_times_s": step_times, "ranks": every, "torch": torch.__version__}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True)
    p.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--peer-adamw", default="fused")
    p.add_argument("--zt-config", default="")
    p.add_argument("--ds-bucket-mb", type=float, default=25.0)
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    phase = Phase(a.out, int(os.environ.get("RANK", 0)))
    phase("start")
    run_rank(a, lambda: run(a, phase), 600)

if __name__ == "__main__":
    main()
