"""Long context: the longest sequence zerotrain trains for 2 steps under a per-rank memory cap.

Run:
    .venv/bin/python bench/longctx.py                         # 2 GiB per rank, 2 gloo ranks
    .venv/bin/python bench/longctx.py --settings plain,tiled,best --cap 2 --max 262144
    .venv/bin/python bench/longctx.py --plan                  # print the runs, run nothing

The model of issue 24: a Hugging Face Llama with random weights (2 layers × 128, 4 heads,
vocabulary 32,000), given to `zerotrain.initialize` as any user's model would be (library
mode), fp32 AdamW, ZeRO-3, one sequence per rank. Per setting the sequence length doubles
from --start until a run does not fit (or fails); each run trains --steps steps under the
cap of bench/capacity_run.py (a watchdog on each rank's resident set, plus a cgroup per
rank with --cgroup) and reports its peak resident memory per rank, its step time and
tokens/s, next to `zerotrain estimate`'s activation prediction for that length.

Settings (zerotrain only; the peers — FSDP2 and DeepSpeed with HF checkpointing — are to
come, through bench/peers_workers.py's jobs):
  plain  no checkpointing, no tiling
  ckpt   model.activation_checkpointing true
  tiled  sequence.tile_tokens --tile
  best   checkpointing (offload on CUDA; a CPU says it is the same as true) + tiling

Writes bench/results/longctx.json (every run) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GiB = 2**30
HF_LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 128,
            "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4}
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ckpt": {"model": {"activation_checkpointing": True}},
    "tiled": {"sequence": {"tile_tokens": "TILE"}},
    "best": {"model": {"activation_checkpointing": "offload"},
             "sequence": {"tile_tokens": "TILE"}},
}


def zerotrain_config(setting: str, tile: int, steps: int) -> dict[str, Any]:
    """The engine's config for a setting (library mode: zerotrain's own sections)."""
    cfg: dict[str, Any] = {"zero": {"stage": 3}, "precision": {"dtype": "fp32"},
                           "optimizer": {"name": "adamw", "lr": 1e-3},
                           "data": {"micro_batch_size": 1}, "train": {"device": "cpu",
                                                                     "steps": steps}}
    for section, values in SETTINGS[setting].items():
        cfg[section] = {k: tile if v == "TILE" else v for k, v in values.items()}
    return cfg


def predicted(setting: str, seq: int, tile: int, device: str = "cpu") -> dict[str, int]:
    """zerotrain's activation prediction (memory/activations.py) for this run."""
    from zerotrain.config import ModelConfig
    from zerotrain.memory import activation_parts

    cfg = zerotrain_config(setting, tile, 2)
    mode = cfg.get("model", {}).get("activation_checkpointing", False)
    conf = dict(HF_LLAMA, max_position_embeddings=seq)
    acts = activation_parts(ModelConfig(hf="(bench)", block_size=seq), 1, seq, act_bytes=4,
                            checkpointing=mode, device=device,
                            tile_tokens=cfg.get("sequence", {}).get("tile_tokens"),
                            hf_config=conf)
    return {"activations_peak": acts.peak, "activations_saved": acts.saved,
            "activations_host": acts.host}


# ---------------------------------------------------------------------------- worker
def worker(a: argparse.Namespace) -> None:
    """One rank: build the HF Llama, train --steps steps at --seq, report memory."""
    import torch
    import torch.distributed as dist
    import transformers

    from peers_workers import run_rank
    from zerotrain.memory import proc_status

    rank = int(os.environ.get("RANK", 0))
    phase = Path(f"{a.out}.rank{rank}.phase")

    def work() -> dict[str, Any]:
        import zerotrain

        torch.set_num_threads(1)
        phase.write_text("build")
        torch.manual_seed(a.seed)
        conf = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **conf, max_position_embeddings=a.seq))
        engine = zerotrain.initialize(model, zerotrain_config(a.setting, a.tile, a.steps))
        g = torch.Generator().manual_seed(a.seed + rank)
        times, losses = [], []
        for step in range(a.steps):
            phase.write_text(f"step {step}")
            x = torch.randint(0, HF_LLAMA["vocab_size"], (1, a.seq), generator=g)
            t0 = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        phase.write_text("report")
        mine = {"peak": proc_status().get("VmHWM", 0), "times": times}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        engine.close()
        step_s = [max(r["times"][i] for r in every) for i in range(a.steps)]
        return {"ok": True, "system": f"zt-{a.setting}", "seq": a.seq, "losses": losses,
                "step_times_s": step_s, "ranks": every}

    a.system = f"zt-{a.setting}"
    run_rank(a, work, 1200)


# ---------------------------------------------------------------------------- driver
def run_length(setting: str, seq: int, a: argparse.Namespace) -> dict[str, Any]:
    """One run (all ranks) at one length, under the cap: bench/capacity_run.py's machinery."""
    import capacity_run as cr

    out = Path(a.work) / f"{setting}-{seq}.json"
    for old in out.parent.glob(out.name + "*"):
        old.unlink()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--setting", setting,
           "--seq", str(seq), "--tile", str(a.tile), "--steps", str(a.steps),
           "--out", str(out)]
    cap = int(a.cap * GiB)
    groups = [cr.RankCgroup(Path(a.cgroup), f"zt-longctx-{os.getpid()}-r{r}", cap)
              if a.cgroup else None for r in range(a.world)]
    port = cr.free_port()
    t0 = time.perf_counter()
    procs = [cr.spawn(cmd, r, a.world, port, Path(f"{out}.rank{r}.log"), groups[r])
             for r in range(a.world)]
    try:
        stop, who, seen = cr.watch(procs, cap, int(1.5 * GiB), a.timeout)
    finally:
        cr.kill_all(procs)
    res = cr.verdict(out, stop, who, seen, procs, groups, cap)
    for g in groups:
        if g is not None:
            g.remove()
    res.update(setting=setting, seq=seq, cap_bytes=cap, wall_s=time.perf_counter() - t0,
               **predicted(setting, seq, a.tile))
    if res.get("verdict") == "ok":
        res["tokens_per_s"] = a.world * seq / min(res["step_times_s"])
    return res


def longest(setting: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Double from --start until a run does not fit; every run's result."""
    runs, seq = [], a.start
    while seq <= a.max:
        res = run_length(setting, seq, a)
        runs.append(res)
        print(f"  {setting:<6} seq {seq:>8,}: {res.get('verdict')}"
              + (f", peak {max(res['peak_rss']) / GiB:.2f} GiB, "
                 f"{res['tokens_per_s']:,.0f} tokens/s" if res.get("verdict") == "ok" else
                 f" ({res.get('error', '')[:80]})"), flush=True)
        if res.get("verdict") != "ok":
            break
        seq *= 2
    return runs


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=float, default=2.0, help="GiB per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--settings", default="plain,ckpt,tiled,best")
    p.add_argument("--start", type=int, default=2048)
    p.add_argument("--max", type=int, default=1 << 20)
    p.add_argument("--tile", type=int, default=2048, help="sequence.tile_tokens")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--cgroup", default=None, help="a memory cgroup to make rank cgroups in")
    p.add_argument("--work", default="/tmp/zerotrain-longctx")
    p.add_argument("--out", default=str(HERE / "results" / "longctx.json"))
    p.add_argument("--plan", action="store_true", help="print the runs, run nothing")
    # worker mode (started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", default="best", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1337, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        worker(a)
        return 0
    settings = [s for s in a.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        print(f"unknown --settings {unknown}; choose from {list(SETTINGS)}", file=sys.stderr)
        return 2
    if a.plan:
        for s in settings:
            lengths = []
            n = a.start
            while n <= a.max:
                lengths.append(n)
                n *= 2
            print(f"{s}: {json.dumps(zerotrain_config(s, a.tile, a.steps))} at "
                  f"{', '.join(f'{x:,}' for x in lengths)} (until one does not fit)")
        return 0
    Path(a.work).mkdir(parents=True, exist_ok=True)
    print(f"longctx: HF Llama 2 x 128, vocab 32,000, fp32 AdamW, ZeRO-3, {a.world} ranks, "
          f"cap {a.cap:g} GiB per rank, {a.steps} steps per length", flush=True)
    results = {s: longest(s, a) for s in settings}
    best = {s: max((r["seq"] for r in runs if r.get("verdict") == "ok"), default=0)
            for s, runs in results.items()}
    print("\nlongest sequence trained per setting:")
    for s, n in best.items():
        print(f"  {s:<6} {n:>9,} tokens")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"cap_gib": a.cap, "world": a.world, "tile": a.tile,
                                       "model": HF_LLAMA, "longest": best,
                                       "runs": results}, indent=1))
    print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
