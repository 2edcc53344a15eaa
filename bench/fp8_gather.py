"""ZeRO-3's parameter all-gather in FP8 vs BF16: bytes per step, counted by the comm layer.

Run: .venv/bin/python bench/fp8_gather.py [--world 2] [--steps 3]
Prints a Markdown table and writes bench/results/fp8_gather.json.

The main job's model (configs/default.yaml, bias-free so every block weight is an FP8
linear's) trains a few steps at ZeRO-3 in BF16 with tensorwise FP8 linears on `--world`
gloo ranks, once gathering the parameters in BF16 and once with
`precision.fp8.all_gather` (the blocks' weights travel as E4M3 plus one scale each). The
numbers are the comm layer's own byte counters for the last step, by purpose
(`Engine.last_traffic`, what `zerotrain train` logs as bytes sent); the two runs' losses
are printed too (tensorwise with power-of-two scales re-quantises a gathered FP8 weight
exactly, so they are equal).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, steps: int, gather: bool, q) -> None:
    from zerotrain.config import load_config
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(str(HERE.parent / "configs" / "default.yaml"), [
        "--zero.stage", "3", "--precision.dtype", "bf16", "--model.bias", "false",
        "--precision.fp8.enabled", "true", "--precision.fp8.recipe", "tensorwise",
        "--precision.fp8.all_gather", str(gather).lower(), "--train.device", "cpu"])
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    b, t, v = cfg.data.micro_batch_size, cfg.model.block_size, cfg.model.vocab_size
    losses = []
    for _ in range(steps):
        x = torch.randint(0, v, (world, b, t + 1), generator=g)[rank]
        loss = eng(x[:, :-1], x[:, 1:])
        eng.backward(loss)
        eng.step()
        losses.append(float(eng.comm.all_reduce_scalars([loss.item()])[0]) / world)
    snap = eng.last_traffic  # the last step's counts (the engine resets them per step)
    eng.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put({"losses": losses, "traffic": snap})


def run(world: int, steps: int, gather: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, steps, gather, q))
             for r in range(world)]
    for p in procs:
        p.start()
    out = q.get(timeout=600)
    for p in procs:
        p.join()
    return out


def sent(snap: dict, purpose: str) -> int:
    return sum(op["sent_bytes"] for op in snap.get(purpose, {}).values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "fp8_gather.json"))
    a = p.parse_args()
    rows = {name: run(a.world, a.steps, gather) for name, gather in
            (("bf16 all-gather", False), ("fp8 all-gather", True))}
    base = sent(rows["bf16 all-gather"]["traffic"], "params")
    print(f"ZeRO-3, {a.world} ranks, main job's model, sent per rank in the last step:\n")
    print("| parameters gathered as | params MB | grads MB | vs bf16 (params) | losses |")
    print("|---|---:|---:|---:|---|")
    for name, r in rows.items():
        pb, gb = sent(r["traffic"], "params"), sent(r["traffic"], "grads")
        losses = " ".join(f"{x:.5f}" for x in r["losses"])
        print(f"| {name} | {pb / 1e6:.3f} | {gb / 1e6:.3f} | {pb / base:.2f}× | {losses} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"world": a.world, "steps": a.steps, **rows}, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
