"""Where one training step's time and resident memory go: zerotrain vs PyTorch DDP.

    .venv/bin/python bench/phases.py                        # zt-0, zt-1 (auto), ddp; 2 ranks
    .venv/bin/python bench/phases.py --systems zt-1 --zt-config '{"optimizer": {"compile": true}}'
    MALLOC_MMAP_THRESHOLD_=131072 .venv/bin/python bench/phases.py   # allocator experiment

`bench/peers.py` says *whether* a system is faster; this says *where*. Each system runs as
a fresh 2-rank gloo job (torchrun) on the peers' small GPT (3.26M parameters, 8 × 128
tokens per rank, AdamW, no clipping; DDP uses torch's fused AdamW). Per measured step it
times forward, backward and the optimizer step and, for zerotrain, the strategy calls
inside them (end-of-backward wait, global norm, update, publish, zeroing), by wrapping
those methods with timers. It also records resident memory (VmRSS) after every step and
the peak (VmHWM), relative to the process before the model existed.

Prints one table and writes `bench/results/phases.json`. Timers add a few microseconds
per call; the numbers are for comparing phases, not for the headline step time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128}
ZT_TIMED = ("finish_backward", "grad_norm_sq", "attach_grads", "after_step", "zero_grad")


def _status() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB."""
    from zerotrain.memory import proc_status

    return {k: v / 2**20 for k, v in proc_status().items() if k in ("VmRSS", "VmHWM")}


def worker(a: argparse.Namespace) -> None:
    """One rank of one system (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from zerotrain.config import ModelConfig, build_config, deep_merge
    from zerotrain.models.gpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    base = _status()["VmRSS"]
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL))
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    if a.system.startswith("zt-"):
        from zerotrain.engine import Engine

        _, stage, *algo = a.system.split("-")
        cfg = {"model": MODEL,
               "optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95],
                             "grad_clip": None},
               "schedule": {"kind": "constant", "warmup_steps": 0},
               "zero": {"stage": int(stage)},
               "comm": {"algorithm": algo[0] if algo else "auto", "backend": "gloo"},
               "train": {"device": "cpu"}}
        if a.zt_config:
            cfg = deep_merge(cfg, json.loads(a.zt_config))
        eng = Engine(model, build_config(cfg), torch.device("cpu"))
        for name in ZT_TIMED:
            timed(eng.strategy, name, name)
        timed(eng.optimizer, "step", "optimizer.step")
        forward, backward, step = eng, eng.backward, eng.step
    elif a.system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
        timed(opt, "step", "optimizer.step")
        timed(opt, "zero_grad", "zero_grad")

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        raise SystemExit(f"unknown system '{a.system}' (zt-<stage>[-native|-ring|-auto] or ddp)")

    gen = torch.Generator().manual_seed(1)
    rss = []
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            spent.clear()
            dist.barrier()
        x = torch.randint(0, 256, (8, MODEL["block_size"]), generator=gen)
        y = torch.randint(0, 256, (8, MODEL["block_size"]), generator=gen)
        t0 = time.perf_counter()
        loss = forward(x, y)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        del loss
        if i >= a.warmup:
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            spent["step"] += t3 - t2
            spent["total"] += t3 - t0
        rss.append(round(_status()["VmRSS"] - base, 1))
    if rank == 0:
        ms = {k: round(v / a.steps * 1e3, 2) for k, v in spent.items()}
        result = {"system": a.system, "zt_config": a.zt_config, "ms_per_step": ms,
                  "rss_after_step_mib": rss, "peak_mib": round(_status()["VmHWM"] - base, 1),
                  "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}
        Path(a.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="zt-0,zt-1,ddp",
                   help="comma list: zt-<stage>[-native|-ring|-auto], ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zt-config", default="", help="JSON merged into the zerotrain config")
    p.add_argument("--out", default=str(HERE / "results" / "phases.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if a.worker:
        worker(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for system in a.systems.split(","):
            out = Path(tmp) / f"{system}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={a.nproc}", str(Path(__file__).resolve()), "--worker",
                   "--system", system, "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--zt-config", a.zt_config, "--out", str(out)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0 or not out.exists():
                raise SystemExit(f"{system} failed:\n{run.stderr[-3000:]}")
            rows.append(json.loads(out.read_text()))
    keys = ["forward", "backward", "step", "total", "optimizer.step", *ZT_TIMED]
    print("| system | " + " | ".join(keys) + " | RSS after last step MiB | peak MiB |")
    print("|---|" + "---:|" * (len(keys) + 2))
    for r in rows:
        ms = r["ms_per_step"]
        cells = [f"{ms[k]:.1f}" if k in ms else "" for k in keys]
        print(f"| {r['system']} | " + " | ".join(cells)
              + f" | {r['rss_after_step_mib'][-1]:.0f} | {r['peak_mib']:.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "args": vars(a)}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
