"""Expert parallelism against plain ZeRO-3 on a MoE whose experts are most of the model.

Run: PYTHONPATH=src .venv/bin/python bench/moe.py [--steps 6] [--experts 16]
Prints a Markdown table and writes bench/results/moe.json.

4 gloo ranks (CPU), the native llama MoE (`model.moe`, Qwen3-MoE's shape: top-2 of E
SwiGLU experts per layer, experts >= 75% of the parameters), the same data on every
row: ZeRO-3 (EP 1) vs ZeRO-3 + `model.moe.expert_parallel` 2 and 4. Per row, from rank
0 over the steps after the first: median step time (wall, and rank 0's process CPU
seconds, steadier on a shared machine); parameter bytes sent per step (the
comm layer's counter, purpose "params": ZeRO-3's all-gathers), gradient bytes
("grads"), the experts' all-to-all bytes ("experts"); model-state bytes held by rank 0
(the strategy's own audit) and its expert parameters' share; the peak RSS of rank 0
above its start (the CPU stand-in for device memory). With `--ds-python` (default: the
repository's .venv-bench, when it exists) DeepSpeed ZeRO-3 trains the same model (EP 1)
in a separate process (bench/moe_ds.py) and adds a row, its bytes counted the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def config(ep: int, experts: int, steps: int):
    from zerotrain.config import build_config

    return build_config({
        "model": {"arch": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128,
                  "intermediate_size": 256, "block_size": 128, "vocab_size": 512,
                  "moe": {"experts": experts, "top_k": 2, "expert_parallel": ep}},
        "zero": {"stage": 3},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "data": {"micro_batch_size": 4},
        "comm": {"algorithm": "native"},
        "train": {"steps": steps, "device": "cpu", "threads": 1},
    })


def worker(rank: int, world: int, port: int, ep: int, experts: int, steps: int,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    cfg = config(ep, experts, steps)
    torch.manual_seed(0)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    eng = Engine(build_model(cfg.model), cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    times, cpu, traffic = [], [], []
    for _ in range(steps):
        x = torch.randint(0, 512, (4, 128), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        eng.backward(eng(x, x.roll(-1, 1)))
        eng.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        traffic.append(eng.last_traffic)
    mem = eng.strategy.memory_breakdown(eng.optimizer.state.values())
    expert = sum(p.numel() for n, p in eng.module.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in eng.module.parameters())
    eng.close()
    if rank == 0:
        def sent(t: dict, purpose: str) -> int:
            return sum(v["sent_bytes"] for v in t.get(purpose, {}).values())

        later = traffic[1:] or traffic
        row = {"ep": ep, "experts": experts, "world": world, "steps": steps,
               "step_s": statistics.median(times[1:] or times),
               "cpu_s": statistics.median(cpu[1:] or cpu),
               "param_bytes": statistics.mean(sent(t, "params") for t in later),
               "grad_bytes": statistics.mean(sent(t, "grads") for t in later),
               "a2a_bytes": statistics.mean(sent(t, "experts") for t in later),
               "model_state_bytes": sum(sum(v.values()) for v in mem.values()),
               "rank_params": total, "rank_expert_params": expert,
               "peak_rss_above_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               * 1024 - start_rss}
        Path(out).write_text(json.dumps(row))
    dist.destroy_process_group()


def run(ep: int, experts: int, steps: int, world: int = 4) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = HERE / "results" / f".moe-ep{ep}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, (world, port, ep, experts, steps, str(out)), nprocs=world)
    return json.loads(out.read_text())


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _count(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def deepspeed_row(python: str, experts: int, steps: int) -> dict:
    """DeepSpeed ZeRO-3's row from its own venv (bench/moe_ds.py), or the error."""
    out = HERE / "results" / ".moe-ds.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([python, str(HERE / "moe_ds.py"), "--out", str(out), "--steps",
                           str(steps), "--experts", str(experts)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        return {"system": "deepspeed", "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| run | step s | CPU s/step | param MB/step | x ZeRO-3 | grad MB/step "
             "| all-to-all MB/step | model states MB (rank 0) | expert params/rank "
             "| peak RSS MB above start |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "ZeRO-3" if r["ep"] == 1 else f"ZeRO-3 + EP {r['ep']}"
        if r.get("system") == "deepspeed":
            name = f"DeepSpeed {r['deepspeed']} ZeRO-3"
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r.get('cpu_s', float('nan')):.3f} | "
            f"{r['param_bytes'] / 1e6:.2f} | "
            f"{r['param_bytes'] / base['param_bytes']:.3f} | {r['grad_bytes'] / 1e6:.2f} | "
            f"{r['a2a_bytes'] / 1e6:.2f} | {_mb(r.get('model_state_bytes'))} | "
            f"{_count(r.get('rank_expert_params'))} | "
            f"{r['peak_rss_above_start'] / 2**20:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ds-python", default=str(ROOT / ".venv-bench" / "bin" / "python"),
                    help="the DeepSpeed venv's python ('' to skip DeepSpeed)")
    args = ap.parse_args()
    from zerotrain.models import build_model

    cfg = config(1, args.experts, args.steps)
    with torch.device("meta"):
        m = build_model(cfg.model)
    total = sum(p.numel() for p in m.parameters())
    share = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n) / total
    rows = [run(ep, args.experts, args.steps) for ep in (1, 2, 4)]
    if args.ds_python and Path(args.ds_python).exists():
        ds = deepspeed_row(args.ds_python, args.experts, args.steps)
        if "error" in ds:
            print(f"DeepSpeed failed: {ds['error']}")
        else:
            rows.append(ds)
    res = {"params": total, "expert_share": share, "rows": rows}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "moe.json").write_text(json.dumps(res, indent=1))
    print(f"{total:,} parameters, experts {share:.1%} of them; 4 gloo ranks, ZeRO-3")
    print(table(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
