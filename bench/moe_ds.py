"""DeepSpeed ZeRO-3 on bench/moe.py's model, as a separate process in the DeepSpeed venv.

Run: PYTHONPATH=src .venv-bench/bin/python bench/moe_ds.py --out ROW.json [--steps 5]
(bench/moe.py runs it when .venv-bench exists.)

The same native llama MoE (built by zerotrain's `build_model`, EP 1: DeepSpeed has no
expert parallelism for a model it did not build), the same data and AdamW, 4 gloo ranks,
`deepspeed.initialize` with ZeRO-3 (prefetch and persistence off, as bench/peers.py sets
them). Bytes are counted the way zerotrain's comm layer counts native collectives: each
torch.distributed collective DeepSpeed calls is wrapped and its payload times the ring
factor ((N−1)/N per reduce-scatter or all-gather pass) is added, under "params" for the
all-gathers and "grads" for the reductions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

SENT = {"params": 0, "grads": 0, "other": 0}
PURPOSE = {"all_gather_into_tensor": "params", "_all_gather_base": "params",
           "all_gather": "params", "reduce_scatter_tensor": "grads",
           "_reduce_scatter_base": "grads", "reduce_scatter": "grads", "all_reduce": "grads"}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _count(name: str, fn):
    def wrapped(*args, **kwargs):
        n = dist.get_world_size(kwargs.get("group"))
        first = args[0] if args else next(iter(kwargs.values()))
        size = _nbytes(first)  # the output (gathers, all-reduce) or the scattered output
        if name.startswith("reduce_scatter") or name == "_reduce_scatter_base":
            size *= n  # the input is N times the output
        factor = 2 if name == "all_reduce" else 1
        if n > 1 and size > 64:  # leave out DeepSpeed's scalar control reductions
            SENT[PURPOSE.get(name, "other")] += int(factor * size * (n - 1) / n)
        return fn(*args, **kwargs)
    return wrapped


def patch() -> None:
    for name in PURPOSE:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, _count(name, fn))


def worker(rank: int, world: int, port: int, experts: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    patch()
    import deepspeed

    from moe import config
    from zerotrain.models import build_model

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = config(1, experts, steps)
    torch.manual_seed(0)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(cfg.model)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "train_batch_size": 4 * world, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "overlap_comm": False},
          "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    g = torch.Generator().manual_seed(rank)
    times, cpu, sent = [], [], []
    for _ in range(steps):
        x = torch.randint(0, 512, (4, 128), generator=g)
        before = dict(SENT)
        t0, c0 = time.perf_counter(), time.process_time()
        engine.backward(engine(x, x.roll(-1, 1)))
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        sent.append({k: SENT[k] - before[k] for k in SENT})
    if rank == 0:
        later = sent[1:] or sent
        row = {"system": "deepspeed", "deepspeed": deepspeed.__version__, "ep": 1,
               "experts": experts, "world": world, "steps": steps,
               "step_s": statistics.median(times[1:] or times),
               "cpu_s": statistics.median(cpu[1:] or cpu),
               "param_bytes": statistics.mean(s["params"] for s in later),
               "grad_bytes": statistics.mean(s["grads"] for s in later),
               "a2a_bytes": 0,
               "peak_rss_above_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               * 1024 - start_rss}
        Path(out).write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, (4, port, a.experts, a.steps, a.out), nprocs=4)


if __name__ == "__main__":
    main()
