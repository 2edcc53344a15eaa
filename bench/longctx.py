"""Long context: the longest sequence each system trains for 2 steps under a per-rank memory
cap — zerotrain side by side with FSDP2 and DeepSpeed ZeRO-3 (both with HF activation
checkpointing).

Run:
    .venv/bin/python bench/longctx.py                       # every system, 2 GiB per rank
    .venv/bin/python bench/longctx.py --systems plain,best,fsdp2-ckpt,ds3-ckpt --max 65536
    .venv/bin/python bench/longctx.py --world 4 --systems sp --start 8192   # SP = 4 row
    .venv/bin/python bench/longctx.py --plan                # print the runs, run nothing
    .venv/bin/python bench/longctx.py --report bench/results/longctx.json  # tables + plot again

The model of issue 24: a Hugging Face Llama with random weights (2 layers × 128, 4 heads,
vocabulary 32,000), fp32 AdamW (lr 1e-3), ZeRO-3 (or its peer equivalent), one sequence
per data-parallel rank. zerotrain gets it as any user's model (library mode,
`zerotrain.initialize`); the peers (bench/longctx_peers.py, run with the DeepSpeed venv
of bench/setup_peers.sh, --peer-python) train it the standard HF way: full logits, then
the loss, with `activation_checkpointing_enable()` on every decoder layer. Per system the
length doubles from --start until a run does not fit (or fails); each run trains --steps
steps under the cap of bench/capacity_run.py (a watchdog on each rank's resident set and
its VmHWM, plus a kernel-enforced cgroup per rank with --cgroup) and reports its peak
resident memory per rank, its step time and tokens/s (the faster step: the first one
pays one-off costs), with `zerotrain estimate`'s activation prediction for the zerotrain
runs.

Then the head-to-head: at each peer's longest length, the peer and zerotrain (the
setting that reaches furthest, and plain when it fits there) run back to back,
alternating, --rounds times each, so the machine's load — it is shared — hits both
alike; the median tokens/s of each is compared.

Systems:
  plain       zerotrain, no checkpointing, no tiling
  ckpt        zerotrain, model.activation_checkpointing true
  tiled       zerotrain, sequence.tile_tokens --tile
  best        zerotrain, checkpointing (offload on CUDA; a CPU says it is the same as
              true) + tiling
  sp          best + sequence.parallel = --world (Ulysses: each rank holds 1/S of the
              sequence; one sequence per group, so tokens/s counts world/S sequences)
  fsdp2-ckpt  FSDP2 fully_shard per layer + HF activation checkpointing
  ds3-ckpt    DeepSpeed ZeRO-3 + HF activation checkpointing

Writes --out (JSON: every run, the longest per system, the head-to-head) and a plot next
to it (<out>.png: length reached per system, peak memory vs length), and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    "sp": {"model": {"activation_checkpointing": "offload"},
           "sequence": {"tile_tokens": "TILE", "parallel": "WORLD"}},
}
PEERS = ("fsdp2-ckpt", "ds3-ckpt")
SYSTEMS = (*SETTINGS, *PEERS)
LABELS = {"plain": "zerotrain plain", "ckpt": "zerotrain checkpointing",
          "tiled": "zerotrain tiles", "best": "zerotrain checkpointing + tiles",
          "sp": "zerotrain checkpointing + tiles + SP",
          "fsdp2-ckpt": "FSDP2 + HF checkpointing",
          "ds3-ckpt": "DeepSpeed ZeRO-3 + HF checkpointing"}


def zerotrain_config(setting: str, tile: int, steps: int, world: int = 2) -> dict[str, Any]:
    """The engine's config for a setting (library mode: zerotrain's own sections)."""
    cfg: dict[str, Any] = {"zero": {"stage": 3}, "precision": {"dtype": "fp32"},
                           "optimizer": {"name": "adamw", "lr": 1e-3},
                           "data": {"micro_batch_size": 1}, "train": {"device": "cpu",
                                                                     "steps": steps}}
    fill = {"TILE": tile, "WORLD": world}
    for section, values in SETTINGS[setting].items():
        cfg[section] = {k: fill.get(v, v) if isinstance(v, str) else v
                        for k, v in values.items()}
    return cfg


def sp_of(setting: str, world: int) -> int:
    return world if setting == "sp" else 1


def predicted(setting: str, seq: int, tile: int, world: int = 2,
              device: str = "cpu") -> dict[str, int]:
    """zerotrain's activation prediction (memory/activations.py) for this run."""
    from zerotrain.config import ModelConfig
    from zerotrain.memory import activation_parts

    cfg = zerotrain_config(setting, tile, 2, world)
    mode = cfg.get("model", {}).get("activation_checkpointing", False)
    conf = dict(HF_LLAMA, max_position_embeddings=seq)
    acts = activation_parts(ModelConfig(hf="(bench)", block_size=seq), 1, seq, act_bytes=4,
                            checkpointing=mode, device=device,
                            tile_tokens=cfg.get("sequence", {}).get("tile_tokens"),
                            hf_config=conf, **sp_kw(sp_of(setting, world)))
    return {"activations_peak": acts.peak, "activations_saved": acts.saved,
            "activations_host": acts.host}


def sp_kw(sp: int) -> dict[str, int]:
    """activation_parts' sequence-parallel argument, where this zerotrain has it."""
    import inspect

    from zerotrain.memory import activation_parts

    has = "sequence_parallel" in inspect.signature(activation_parts).parameters
    return {"sequence_parallel": sp} if has else {}


# ---------------------------------------------------------------------------- worker
def worker(a: argparse.Namespace) -> None:
    """One zerotrain rank: build the HF Llama, train --steps steps at --seq, report memory."""
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
        world = dist.get_world_size()
        sp = sp_of(a.setting, world)
        phase.write_text("build")
        torch.manual_seed(a.seed)
        conf = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **conf, max_position_embeddings=a.seq))
        engine = zerotrain.initialize(model, zerotrain_config(a.setting, a.tile, a.steps,
                                                              world))
        # every rank of a sequence-parallel group passes the same whole sequence
        g = torch.Generator().manual_seed(a.seed + rank // sp)
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
        # the engine resets VmHWM before each phase of its first steps (PhasePeaks): the
        # process's peak is the largest phase peak, or VmHWM since the last reset
        phases = engine.phases.report()
        mine = {"peak": max(proc_status().get("VmHWM", 0),
                            *(v for k, v in phases.items() if k != "baseline")),
                "phase_peaks": phases, "times": times}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        engine.close()
        step_s = [max(r["times"][i] for r in every) for i in range(a.steps)]
        return {"ok": True, "system": a.setting, "seq": a.seq, "losses": losses,
                "step_times_s": step_s, "ranks": every, "sequence_parallel": sp}

    a.system = a.setting
    run_rank(a, work, 1200)


# ---------------------------------------------------------------------------- driver
def command(system: str, seq: int, out: Path, a: argparse.Namespace) -> list[str]:
    if system in PEERS:
        return [a.peer_python, str(HERE / "longctx_peers.py"), "--system", system,
                "--seq", str(seq), "--steps", str(a.steps), "--out", str(out)]
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--setting", system,
            "--seq", str(seq), "--tile", str(a.tile), "--steps", str(a.steps),
            "--out", str(out)]


def run_length(system: str, seq: int, a: argparse.Namespace, tag: str = "") -> dict[str, Any]:
    """One run (all ranks) at one length, under the cap: bench/capacity_run.py's machinery."""
    import capacity_run as cr

    out = Path(a.work) / f"{system}-{seq}{tag}.json"
    for old in out.parent.glob(out.name + "*"):
        old.unlink()
    cap = int(a.cap * GiB)
    groups = [cr.RankCgroup(Path(a.cgroup), f"zt-longctx-{os.getpid()}-r{r}", cap)
              if a.cgroup else None for r in range(a.world)]
    port = cr.free_port()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    procs = [cr.spawn(command(system, seq, out, a), r, a.world, port,
                      Path(f"{out}.rank{r}.log"), groups[r]) for r in range(a.world)]
    try:
        stop, who, seen = cr.watch(procs, cap, int(1.5 * GiB), a.timeout)
    finally:
        cr.kill_all(procs)
    res = cr.verdict(out, stop, who, seen, procs, groups, cap)
    for g in groups:
        if g is not None:
            g.remove()
    res.update(system=system, seq=seq, cap_bytes=cap, wall_s=time.perf_counter() - t0,
               world=a.world, load_avg_1m=[load0, os.getloadavg()[0]],
               log=f"{out}.rank0.log")
    if system not in PEERS:
        res.update(predicted(system, seq, a.tile, a.world))
    if res.get("verdict") == "ok":
        dp = a.world // sp_of(system, a.world)
        res["tokens_per_s"] = dp * seq / min(res["step_times_s"])
    return res


def show(res: dict[str, Any]) -> str:
    if res.get("verdict") == "ok":
        return (f"ok, peak {max(res['peak_rss']) / GiB:.2f} GiB/rank, "
                f"{res['tokens_per_s']:,.0f} tokens/s, loss {res['losses'][-1]:.3f}")
    return f"{res.get('verdict')} ({str(res.get('error', ''))[:90]})"


def longest(system: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Double from --start until a run does not fit; every run's result."""
    runs, seq = [], a.start
    while seq <= a.max:
        res = run_length(system, seq, a)
        runs.append(res)
        print(f"  {system:<10} seq {seq:>8,}: {show(res)}", flush=True)
        if res.get("verdict") != "ok":
            break
        seq *= 2
    return runs


def reached(runs: list[dict[str, Any]]) -> int:
    return max((r["seq"] for r in runs if r.get("verdict") == "ok"), default=0)


def head_to_head(results: dict[str, list[dict]], a: argparse.Namespace) -> list[dict]:
    """At each peer's longest length: the peer and zerotrain back to back, alternating."""
    zt = [s for s in results if s not in PEERS]
    if not zt:
        return []
    far = max(zt, key=lambda s: reached(results[s]))
    out = []
    for peer in [s for s in results if s in PEERS]:
        L = reached(results[peer])
        if not L:
            continue
        mine = [far] + [s for s in zt if s != far and any(
            r["seq"] == L and r.get("verdict") == "ok" for r in results[s])]
        order = [peer, *mine]
        runs: dict[str, list[dict]] = {s: [] for s in order}
        for rnd in range(a.rounds):
            for s in order:
                res = run_length(s, L, a, tag=f".h2h{rnd}")
                runs[s].append(res)
                print(f"  head-to-head {s:<10} seq {L:>8,} round {rnd}: {show(res)}",
                      flush=True)
        tps = {s: statistics.median(r["tokens_per_s"] for r in rs if r.get("verdict") == "ok")
               if any(r.get("verdict") == "ok" for r in rs) else None
               for s, rs in runs.items()}
        zbest = max((s for s in mine if tps[s]), key=lambda s: tps[s], default=None)
        out.append({"peer": peer, "seq": L, "median_tokens_per_s": tps,
                    "zerotrain_fastest": zbest,
                    "ratio": (tps[zbest] / tps[peer]) if zbest and tps[peer] else None,
                    "runs": runs})
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    systems = list(doc["runs"])
    names = [LABELS.get(s, s) for s in systems]
    left.barh(names, [max(doc["longest"][s], 1) for s in systems], color=[
        "tab:gray" if s in PEERS else "tab:blue" for s in systems])
    left.set_xscale("log", base=2)
    left.set_xlim(left=doc["runs"] and min(r["seq"] for rs in doc["runs"].values()
                                           for r in rs) / 2)
    left.set_xlabel("longest sequence trained (tokens)")
    left.set_title(f"{doc['world']} ranks, {doc['cap_gib']:g} GiB per rank")
    for i, s in enumerate(systems):
        left.text(max(doc["longest"][s], 1), i, f" {doc['longest'][s]:,}", va="center")
    for s in systems:
        pts = [(r["seq"], max(r["peak_rss"]) / GiB) for r in doc["runs"][s]
               if r.get("verdict") == "ok"]
        if pts:
            line, = right.plot(*zip(*pts), marker="o", ls="--" if s in PEERS else "-",
                               label=LABELS.get(s, s))
            failed = [r["seq"] for r in doc["runs"][s] if r.get("verdict") != "ok"]
            if failed:  # the length that did not fit (or ran out of time): an x at the cap
                right.plot(failed[:1], [doc["cap_gib"]], marker="x", ms=10, ls="none",
                           color=line.get_color())
    right.axhline(doc["cap_gib"], color="red", lw=1, label="cap")
    right.set_xscale("log", base=2)
    right.set_xlabel("sequence length (tokens)")
    right.set_ylabel("peak resident memory per rank (GiB; x: did not fit or timed out)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tables(doc: dict[str, Any]) -> str:
    lines = ["| system | sequence | peak RSS per rank (GiB) | tokens/s | loss (step 2) |",
             "|---|---|---|---|---|"]
    for s, runs in doc["runs"].items():
        for r in runs:
            ok = r.get("verdict") == "ok"
            lines.append(f"| {LABELS.get(s, s)} | {r['seq']:,} | "
                         + (f"{' / '.join(f'{p / GiB:.2f}' for p in r['peak_rss'])} | "
                            f"{r['tokens_per_s']:,.0f} | {r['losses'][-1]:.3f} |" if ok else
                            f"{r.get('verdict')} ({r.get('oom_phase', '')}) | – | – |"))
    lines += ["", "| system | longest sequence |", "|---|---|"]
    lines += [f"| {LABELS.get(s, s)} | {n:,} |" for s, n in doc["longest"].items()]
    for h in doc.get("head_to_head", []):
        lines += ["", f"head-to-head at {h['seq']:,} tokens ({doc['rounds']} alternating "
                  "rounds, median tokens/s):"]
        lines += [f"  {LABELS.get(s, s)}: " + (f"{t:,.0f}" if t else "did not run")
                  for s, t in h["median_tokens_per_s"].items()]
        if h["ratio"]:
            lines.append(f"  zerotrain ({h['zerotrain_fastest']}) / {h['peer']}: "
                         f"{h['ratio']:.2f}x")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=float, default=2.0, help="GiB per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--systems", default="plain,best,fsdp2-ckpt,ds3-ckpt",
                   help=f"comma list from {', '.join(SYSTEMS)}")
    p.add_argument("--start", type=int, default=2048)
    p.add_argument("--max", type=int, default=1 << 20)
    p.add_argument("--tile", type=int, default=2048, help="sequence.tile_tokens")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="head-to-head runs per system "
                   "(0: none)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--cgroup", default=None, help="a memory cgroup to make rank cgroups in")
    p.add_argument("--peer-python", default="/tmp/venv-bench/bin/python",
                   help="interpreter with DeepSpeed and transformers (bench/setup_peers.sh)")
    p.add_argument("--work", default="/tmp/zerotrain-longctx")
    p.add_argument("--out", default=str(HERE / "results" / "longctx.json"))
    p.add_argument("--plan", action="store_true", help="print the runs, run nothing")
    p.add_argument("--report", metavar="JSON", help="run nothing: the tables and plot of a "
                   "results file written earlier")
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
    if a.report:
        doc = json.loads(Path(a.report).read_text())
        plot(doc, Path(a.report).with_suffix(".png"))
        print(tables(doc))
        return 0
    systems = [s for s in a.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"unknown --systems {unknown}; choose from {list(SYSTEMS)}", file=sys.stderr)
        return 2
    if "sp" in systems and HF_LLAMA["num_attention_heads"] % a.world:
        print(f"--systems sp: sequence.parallel {a.world} must divide the model's "
              f"{HF_LLAMA['num_attention_heads']} heads; use --world 2 or 4", file=sys.stderr)
        return 2
    if a.plan:
        n, lengths = a.start, []
        while n <= a.max:
            lengths.append(n)
            n *= 2
        for s in systems:
            what = ("bench/longctx_peers.py" if s in PEERS
                    else json.dumps(zerotrain_config(s, a.tile, a.steps, a.world)))
            print(f"{s}: {what} at {', '.join(f'{x:,}' for x in lengths)} "
                  "(until one does not fit)")
        return 0
    # the ranks import zerotrain and these bench modules from this checkout
    src = str(HERE.parent / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [src, str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    Path(a.work).mkdir(parents=True, exist_ok=True)
    print(f"longctx: HF Llama 2 x 128, vocab 32,000, fp32 AdamW, ZeRO-3, {a.world} ranks, "
          f"cap {a.cap:g} GiB per rank, {a.steps} steps per length, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    doc: dict[str, Any] = {"cap_gib": a.cap, "world": a.world, "tile": a.tile,
                           "steps": a.steps, "rounds": a.rounds, "model": HF_LLAMA,
                           "cores": os.cpu_count(), "started": time.strftime(
                               "%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:], "runs": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for s in systems:
        doc["runs"][s] = longest(s, a)
        doc["longest"] = {k: reached(v) for k, v in doc["runs"].items()}
        out.write_text(json.dumps(doc, indent=1))  # a long run that stops keeps its rows
    if a.rounds:
        doc["head_to_head"] = head_to_head(doc["runs"], a)
    peers = [doc["longest"][s] for s in doc["runs"] if s in PEERS]
    zt = [doc["longest"][s] for s in doc["runs"] if s not in PEERS]
    if peers and zt and max(peers):
        doc["longest_ratio"] = max(zt) / max(peers)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print("\n" + tables(doc))
    if "longest_ratio" in doc:
        print(f"\nzerotrain's longest / the best peer's: {doc['longest_ratio']:.0f}x")
    print(f"written to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
