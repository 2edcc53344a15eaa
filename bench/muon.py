"""Distributed Muon's optimizer step: replicated vs whole-matrix owners, on gloo CPU ranks.

    .venv/bin/python bench/muon.py                                  # gpt + llama-60m, N = 2, 4
    .venv/bin/python bench/muon.py --models gpt --worlds 2 --steps 3

Systems (each system, world size and round is its own torchrun job; rounds alternate the
systems' order):
- `replicated`: stage 0 — every rank all-reduces the gradients and runs Newton–Schulz on
  every matrix (today's DDP Muon).
- `owner`: ZeRO-1 with distributed Muon (zero/muon.py) — each matrix's reduced gradient
  pieces go to its owner in one all-to-all, the owner runs Newton–Schulz, and O comes
  back in a second all-to-all.
- `owner-gather`: the same, but O comes back by gather-then-keep-slice (one all-gather
  of every owner's updates; each rank keeps its slices).
- `owner-scatter`: the same, but O comes back by one scatter from each owner in turn.

What is timed: `strategy.optimizer_step` (attach, the Muon exchange, optimizer.step —
Newton–Schulz and the AdamW fallback —, detach, apply), the slowest rank per step, median
over the measured steps of every round; and the CPU time of the same region (the busiest
rank), which a shared machine's load distorts far less than wall time. Gradient reduction
and the weight publish are outside it (the same bytes for stage 0's all-reduce and
ZeRO-1's reduce-scatter + all-gather). Bytes: what one rank sends in the Muon exchange
per step (max and mean over ranks, counted by Comm), beside the model's prediction for
the all-to-all (`memory.muon_traffic`). One thread per rank.

Models: the reference GPT (configs/default.yaml's shape: 4 layers, n_embd 192, byte
vocabulary) and a llama preset (default llama-60m: 8 layers, n_embd 512, SwiGLU 1376).
Prints a Markdown table and writes bench/results/muon.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYSTEMS = {"replicated": (0, None), "owner": (1, "all_to_all"),
           "owner-gather": (1, "all_gather"), "owner-scatter": (1, "scatter")}
MODELS = {"gpt": {"n_layer": 4, "n_head": 6, "n_embd": 192, "block_size": 128}}
SEQ = 32  # tokens per rank and step: the optimizer step does not depend on the batch


def model_config(name: str) -> dict:
    return MODELS.get(name) or {"preset": name, "block_size": 128}


def _config(model: str, stage: int) -> dict:
    return {"model": model_config(model),
            "optimizer": {"name": "muon", "lr": 0.02, "grad_clip": 1.0},
            "schedule": {"kind": "constant", "warmup_steps": 0},
            "zero": {"stage": stage}, "data": {"micro_batch_size": 1},
            "comm": {"backend": "gloo"}, "train": {"device": "cpu", "steps": 100}}


def run_system(model: str, system: str, steps: int, warmup: int) -> dict[str, Any]:
    """One system on the open process group: per-step times and Muon bytes of this rank."""
    import torch

    from zerotrain.config import build_config
    from zerotrain.engine import Engine
    from zerotrain.models import build_model
    from zerotrain.zero.muon import MatrixOwners

    stage, method = SYSTEMS[system]
    cfg = build_config(_config(model, stage))
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model), cfg, torch.device("cpu"))
    s = eng.strategy
    if method is not None:
        s.updater.method = method
    times: list[float] = []
    cpu: list[float] = []
    step_fn = s.optimizer_step

    def timed(optimizer: Any) -> None:
        t, c = time.perf_counter(), time.process_time()
        step_fn(optimizer)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)

    s.optimizer_step = timed
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.model.vocab_size
    muon_bytes, total_bytes = [], []
    for _ in range(warmup + steps):
        x = torch.randint(0, vocab, (1, SEQ), generator=gen)
        eng.backward(eng(x, x))
        eng.step()
        muon_bytes.append(sum(v["sent_bytes"] for v in eng.last_traffic.get("muon", {}).values()))
        total_bytes.append(eng.last_traffic_bytes[0])
    out = {"times": times[warmup:], "cpu": cpu[warmup:], "muon_bytes": muon_bytes[warmup:],
           "total_bytes": total_bytes[warmup:],
           "params": sum(p.numel() for p in eng.module.parameters())}
    out["predicted_bytes"] = 0
    if isinstance(s.updater, MatrixOwners):
        from zerotrain.memory import muon_traffic

        summary = s.updater.summary()
        out.update(shares=summary["shares"], matrices=summary["matrices"],
                   straddling=len(summary["straddling"]))
        if method == "all_to_all":  # the model of the chosen scheme, this rank's bytes
            pred = muon_traffic(summary["pieces"], eng.rank, grad_bytes=4, update_bytes=4)
            out["predicted_bytes"] = sum(c.sent_bytes for c in pred)
    eng.close()
    return out


def worker(a: argparse.Namespace) -> None:
    """One system of one (model, N), under torchrun: a fresh process group per system."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    r = run_system(a.model, a.system, a.steps, a.warmup)
    t = torch.tensor([r["times"], r["cpu"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets each step
    b = torch.tensor([float(max(r["muon_bytes"])), float(max(r["total_bytes"])),
                      float(r["predicted_bytes"])], dtype=torch.float64)
    bmax, bsum = b.clone(), b.clone()
    dist.all_reduce(bmax, op=dist.ReduceOp.MAX)
    dist.all_reduce(bsum)
    if dist.get_rank() == 0:
        row = {"model": a.model, "world": n, "system": a.system,
               "step_ms_all": [x * 1e3 for x in t[0].tolist()],
               "cpu_ms_all": [x * 1e3 for x in t[1].tolist()],
               "muon_bytes_max": int(bmax[0]), "muon_bytes_mean": float(bsum[0]) / n,
               "total_bytes_max": int(bmax[1]), "predicted_bytes_max": int(bmax[2]),
               "params": r["params"],
               **{k: r[k] for k in ("shares", "matrices", "straddling") if k in r}}
        Path(a.out).write_text(json.dumps(row))
    dist.destroy_process_group()
    # About one exit in four aborted in C++ teardown ("terminate called without an active
    # exception", no Python frame; also for `replicated`, i.e. without the Muon exchange;
    # not seen with bench/phases.py's worker), after the results were written: skip it.
    sys.stdout.flush()
    os._exit(0)


def _merge(runs: list[dict]) -> dict:
    """One row from a system's rounds: medians over every measured step."""
    row = dict(runs[0])
    row["step_ms_all"] = [x for r in runs for x in r["step_ms_all"]]
    row["cpu_ms_all"] = [x for r in runs for x in r["cpu_ms_all"]]
    row["step_ms"] = statistics.median(row["step_ms_all"])
    row["cpu_ms"] = statistics.median(row["cpu_ms_all"])
    return row


def _table(rows: list[dict]) -> str:
    lines = ["| model | N | system | step ms | × replicated | CPU ms | × replicated | "
             "NS share (max rank) | Muon bytes/step/rank (max) | all bytes/step/rank (max) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["model"], r["world"]): r for r in rows if r["system"] == "replicated"}
    for r in rows:
        ref = base.get((r["model"], r["world"]))
        ratio = f"{r['step_ms'] / ref['step_ms']:.2f}" if ref else ""
        cratio = f"{r['cpu_ms'] / ref['cpu_ms']:.2f}" if ref else ""
        share = f"{max(r['shares']):.1%}" if "shares" in r else "100%"
        lines.append(f"| {r['model']} | {r['world']} | {r['system']} | {r['step_ms']:.1f} | "
                     f"{ratio} | {r['cpu_ms']:.1f} | {cratio} | {share} | "
                     f"{r['muon_bytes_max']:,} | {r['total_bytes_max']:,} |")
    return "\n".join(lines)


def _job(a: argparse.Namespace, model: str, n: int, system: str, tmp: Path) -> dict:
    out = tmp / f"{model}-{n}-{system}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(Path(__file__).resolve()), "--worker",
           "--model", model, "--system", system, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not out.exists():
        raise SystemExit(f"{model} N={n} {system} failed:\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama-60m", help="gpt and/or preset names")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="repetitions, order alternating")
    p.add_argument("--out", default=str(HERE / "results" / "muon.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    unknown = set(a.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if a.worker:
        worker(a)
        return
    rows: list[dict] = []
    systems = a.systems.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            for n in (int(w) for w in a.worlds.split(",")):
                got: dict[str, list[dict]] = {s: [] for s in systems}
                for i in range(a.rounds):  # alternate the order: load drift hits all alike
                    for system in systems if i % 2 == 0 else systems[::-1]:
                        got[system].append(_job(a, model, n, system, Path(tmp)))
                rows += [_merge(got[s]) for s in systems]
                print(_table(rows[-len(systems):]), flush=True)
    print(_table(rows))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "args": vars(a)}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
