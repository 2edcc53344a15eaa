"""zerotrain vs its peers: the same GPT, data, seed and AdamW, trained by every system.

Run (after `bash bench/setup_peers.sh`):
    .venv-bench/bin/python bench/peers.py              # full run, ~15 min on 2 cores
    .venv-bench/bin/python bench/peers.py --quick      # smoke check, ~2 min
    .venv-bench/bin/python bench/peers.py --systems zt-2,fsdp2,ds-2 --rounds 5

Systems: zerotrain stages 0-3 and Offload (native and ring collectives, fp32 and some
bf16), PyTorch DDP, DDP + ZeroRedundancyOptimizer, FSDP2 (`fully_shard`, with and
without resharding after forward, with CPUOffloadPolicy, fp32 and bf16 mixed
precision) and DeepSpeed ZeRO 0-3. Each run is a fresh 2-rank gloo job started by
torchrun (`bench/peers_workers.py` holds the per-system code); runs alternate between
systems round by round (A B C … A B C …) so a drift in machine speed hits all alike.

Prints a Markdown table and writes bench/results/<name>.md and <name>.json (default
name "peers"); per-run logs go to bench/results/logs/. See bench/README.md for what
every column means.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers_workers import ALL_SYSTEMS, DS_SYSTEMS, TORCH_SYSTEMS, ZT_SYSTEMS, describe  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # name: model fields + micro-batch per rank
    "tiny": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}, "mb": 4},
    "small": {"model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128}, "mb": 8},
    "medium": {"model": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256}, "mb": 8},
}
DEFAULT_SYSTEMS = ZT_SYSTEMS + TORCH_SYSTEMS + DS_SYSTEMS
QUICK_SYSTEMS = ["zt-0", "zt-1", "zt-2", "zt-3", "zt-2-off", "zt-3-ring", "zt-2-bf16",
                 "ddp", "ddp-zero", "fsdp2", "fsdp2-reshard", "fsdp2-offload", "fsdp2-bf16",
                 *DS_SYSTEMS]
GROUPS = {"zt": ZT_SYSTEMS, "torch": TORCH_SYSTEMS, "ds": DS_SYSTEMS,
          "default": DEFAULT_SYSTEMS, "quick": QUICK_SYSTEMS, "all": ALL_SYSTEMS}
# Memory class -> the peers a zerotrain row is compared with (bf16 rows use the -bf16 twins).
CLASS_PEERS = {
    "stage0/1": ["ddp", "ddp-zero"],
    "stage2": ["fsdp2", "ds-2"],
    "stage3": ["fsdp2-reshard", "ds-3"],
    "offload": ["fsdp2-offload"],
}
REFERENCE = "ddp"
TOL = {"fp32": 1e-4, "bf16": 1e-2}  # |Δ final loss| vs DDP fp32; see README for why


# ---------------------------------------------------------------------------- setup
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (10)")
    p.add_argument("--warmup", type=int, default=None, help="discarded steps per run (3)")
    p.add_argument("--rounds", type=int, default=None, help="runs per system (3)")
    p.add_argument("--systems", default=None,
                   help="comma list of names or groups (zt, torch, ds, default, quick, all); "
                   f"names: {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--model-size", choices=list(PRESETS), default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 1 round, 4 steps, a representative subset: a smoke check")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--data", choices=["corpus", "random"], default="corpus",
                   help="stdlib-source windows via WindowSampler, or seeded random tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--peer-adamw", choices=["default", "loop", "foreach", "fused"],
                   default="fused", help="torch.optim.AdamW flavour the peers use")
    p.add_argument("--zt-config", default="",
                   help="JSON merged into every zerotrain config, e.g. "
                   '\'{"zero": {"bucket_mb": 4}}\'')
    p.add_argument("--ds-bucket-mb", type=float, default=25.0)
    p.add_argument("--netns", choices=["auto", "on", "off"], default="auto",
                   help="run each job in its own network namespace so loopback bytes are "
                   "its own (needs root and `unshare`)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--name", default="peers", help="result file stem")
    p.add_argument("--profile", action="store_true",
                   help="also write a torch.profiler table per run (rank 0)")
    p.add_argument("--count-calls", action="store_true",
                   help="also count torch.distributed calls per step (Python level)")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="run nothing: rebuild the table from a results JSON written earlier")
    a = p.parse_args(argv)
    quick = a.quick
    a.model_size = a.model_size or ("tiny" if quick else "small")
    a.steps = a.steps or (4 if quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if quick else 3)
    a.rounds = a.rounds or (1 if quick else 3)
    a.micro_batch = a.micro_batch or PRESETS[a.model_size]["mb"]
    names: list[str] = []
    for tok in (a.systems or ("quick" if quick else "default")).split(","):
        tok = tok.strip()
        if not tok:
            continue
        if tok in GROUPS:
            names += GROUPS[tok]
        elif tok in ALL_SYSTEMS:
            names.append(tok)
        else:
            p.error(f"unknown system '{tok}'; choose from {', '.join([*GROUPS, *ALL_SYSTEMS])}")
    a.system_list = list(dict.fromkeys(names))
    return a


def netns_works() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    r = subprocess.run(["unshare", "-n", "--", "ip", "link", "set", "lo", "up"],
                       capture_output=True)
    return r.returncode == 0


def make_data(a: argparse.Namespace, path: Path) -> None:
    """warmup + steps + 1 global batches (the last is held out for the final loss)."""
    import torch

    n = a.warmup + a.steps + 1
    gb = a.micro_batch * a.nproc
    T = PRESETS[a.model_size]["model"]["block_size"]
    if a.data == "random":
        g = torch.Generator().manual_seed(a.seed)
        x = torch.randint(0, 256, (n, gb, T + 1), generator=g)
    else:
        from zerotrain.data.corpus import load_tokens
        from zerotrain.data.sampler import WindowSampler

        s = WindowSampler(load_tokens(None), T, a.seed)
        x = torch.stack([_window_rows(s, i * gb, gb) for i in range(n)])
    torch.save({"x": x[..., :-1].contiguous(), "y": x[..., 1:].contiguous()}, path)


def _window_rows(sampler: Any, start: int, count: int) -> Any:
    """Rows of T+1 tokens (inputs and shifted targets together) for windows start..start+count."""
    import torch

    inputs, targets = sampler.windows(sampler.window_ids(start, count))
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def machine_info(a: argparse.Namespace, netns: bool) -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cores": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
        "python": platform.python_version(), "torch": version("torch"),
        "deepspeed": version("deepspeed"), "zerotrain": version("zerotrain"),
        "load_avg_start": os.getloadavg(), "netns": netns,
    }


# ---------------------------------------------------------------------------- running
def run_one(a: argparse.Namespace, system: str, rnd: int, data: Path, netns: bool,
            logs: Path) -> dict[str, Any]:
    out = logs / f"{system}.r{rnd}.json"
    for old in logs.glob(f"{system}.r{rnd}.json*"):
        old.unlink()
    model = json.dumps(PRESETS[a.model_size]["model"])
    cmd = [a.python, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(a.nproc), str(HERE / "peers_workers.py"),
           "--system", system, "--data", str(data), "--out", str(out), "--model", model,
           "--micro-batch", str(a.micro_batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--lr", str(a.lr), "--seed", str(a.seed),
           "--threads", str(a.threads), "--peer-adamw", a.peer_adamw,
           "--ds-bucket-mb", str(a.ds_bucket_mb)]
    if a.zt_config:
        cmd += ["--zt-config", a.zt_config]
    if a.profile:
        cmd.append("--profile")
    if a.count_calls:
        cmd.append("--count-calls")
    if netns:
        cmd = ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(a.threads),
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    log = logs / f"{system}.r{rnd}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=a.timeout, cwd=HERE.parent).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - t0
    if out.exists():
        res = json.loads(out.read_text())
    else:
        errs = sorted(logs.glob(f"{system}.r{rnd}.json.rank*.err"))
        if errs:
            res = json.loads(errs[0].read_text())
        else:
            why = "timed out" if rc is None else f"exit code {rc}"
            res = {"system": system, "ok": False, "error": f"{why}; see {log}"}
    res["round"], res["job_wall_s"], res["log"] = rnd, wall, str(log)
    return res


# ---------------------------------------------------------------------------- summary
def summarize(system: str, runs: list[dict], a: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    row: dict[str, Any] = {"system": system, **describe(system), "runs": len(runs),
                           "ok_runs": len(ok)}
    if not ok:
        row["ok"] = False
        row["error"] = runs[0].get("error", "unknown") if runs else "not run"
        return row
    times = [t for r in ok for t in r["step_times_s"]]
    round_medians = [statistics.median(r["step_times_s"]) for r in ok]
    tokens = a.micro_batch * a.nproc * PRESETS[a.model_size]["model"]["block_size"]
    peak = [max(r["peak_rss_bytes"]) for r in ok]
    base = [max(r["base_rss_bytes"]) for r in ok]
    sent = [r["sent_bytes_per_step"] for r in ok if r.get("sent_bytes_per_step") is not None]
    lo = [r["loopback_bytes_per_rank_step"] for r in ok
          if r.get("loopback_bytes_per_rank_step") is not None]
    finals = [r["final_loss"] for r in ok]
    # The median of the per-round medians: a round slowed down as a whole by the
    # machine (seen here: other tenants on the 2 cores) does not move it.
    step = statistics.median(round_medians)
    row.update(
        ok=True, step_s=step, round_medians_s=round_medians,
        pooled_median_s=statistics.median(times), min_step_s=min(times),
        tokens_per_s=tokens / step,
        peak_rss_bytes=statistics.median(peak), base_rss_bytes=statistics.median(base),
        sent_bytes_per_step=statistics.median(sent) if sent else None,
        sent_how=ok[0].get("sent_how", "n/a"),
        loopback_bytes_per_rank_step=statistics.median(lo) if lo else None,
        final_loss=finals[0], final_loss_spread=max(finals) - min(finals),
        losses=ok[0]["losses"], notes=ok[0].get("notes", {}),
        dist_calls_per_step=ok[0].get("dist_calls_per_step"),
        errors=[r.get("error") for r in runs if not r.get("ok")],
    )
    return row


def add_loss_checks(rows: dict[str, dict]) -> float | None:
    ref = rows.get(REFERENCE)
    ref_loss = ref["final_loss"] if ref and ref.get("ok") else None
    for r in rows.values():
        if not r.get("ok") or ref_loss is None:
            continue
        r["loss_delta"] = abs(r["final_loss"] - ref_loss)
        r["loss_tol"] = TOL[r["precision"]]
        r["loss_ok"] = r["loss_delta"] <= r["loss_tol"]
    return ref_loss


def ratios(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """zerotrain / best peer of its memory class: step time and peak RSS (≤1: we win)."""
    out = []
    for r in rows.values():
        if r["family"] != "zerotrain" or not r.get("ok"):
            continue
        suffix = "-bf16" if r["precision"] == "bf16" else ""
        names = [n + suffix for n in CLASS_PEERS[r["memory_class"]]]
        if r["memory_class"] == "offload":
            names += [n for n in rows if n.startswith("ds-") and n.endswith("-off") and not suffix]
        peers = [rows[n] for n in names if n in rows and rows[n].get("ok")]
        entry: dict[str, Any] = {"system": r["system"], "memory_class": r["memory_class"],
                                 "precision": r["precision"], "peers": names}
        if peers:
            ft = min(peers, key=lambda p: p["step_s"])
            fm = min(peers, key=lambda p: p["peak_rss_bytes"])
            fr = min(peers, key=lambda p: min(p["round_medians_s"]))
            entry.update(best_round_peer=fr["system"],
                         best_round_ratio=min(r["round_medians_s"]) / min(fr["round_medians_s"]))
            entry.update(best_time_peer=ft["system"], time_ratio=r["step_s"] / ft["step_s"],
                         best_rss_peer=fm["system"],
                         rss_ratio=r["peak_rss_bytes"] / fm["peak_rss_bytes"],
                         rss_delta_ratio=_safe_div(r["peak_rss_bytes"] - r["base_rss_bytes"],
                                                   fm["peak_rss_bytes"] - fm["base_rss_bytes"]))
        out.append(entry)
    return out


def _safe_div(x: float, y: float) -> float | None:
    return x / y if y > 0 else None


def _mb(x: float | None, unit: float = 2**20, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x / unit)


def markdown(meta: dict, a: argparse.Namespace, rows: dict[str, dict], rat: list[dict],
             ref_loss: float | None) -> str:
    m = PRESETS[a.model_size]["model"]
    lines = [
        f"# zerotrain vs peers — {meta['date']}",
        "",
        f"Machine: {meta['cores']} cores ({meta['cpu']}), {meta['platform']}, Python "
        f"{meta['python']}, torch {meta['torch']}, deepspeed {meta['deepspeed']}, zerotrain "
        f"{meta['zerotrain']}. {a.nproc} ranks × {a.threads} thread(s), gloo over loopback "
        f"(own network namespace per run: {meta['netns']}).",
        f"Model: GPT {m['n_layer']} layers, n_embd {m['n_embd']}, {m['n_head']} heads, block "
        f"{m['block_size']}, {meta['params']:,} parameters; micro-batch {a.micro_batch}/rank "
        f"(global {a.micro_batch * a.nproc} × {m['block_size']} tokens), data {a.data}, "
        f"AdamW lr {a.lr} constant, wd 0.1 on matrices, no clipping; peers' AdamW: "
        f"{a.peer_adamw}. {a.rounds} round(s) × {a.steps} measured steps after {a.warmup} "
        f"warmup steps; {meta['wall_s']:.0f} s in all.",
        "",
        "| system | class | prec | step ms | round medians ms | tokens/s | peak RSS MiB "
        "| Δ RSS MiB | sent MB/rank/step | loopback MB/rank/step | final loss | Δ loss vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        if not r.get("ok"):
            err = str(r.get("error", "")).replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {r['system']} ({r['label']}) | {r['memory_class']} | "
                         f"{r['precision']} | FAILED: {err} | | | | | | | | |")
            continue
        sent = "n/a"
        if r["sent_bytes_per_step"] is not None:
            how = r["sent_how"].split()[-1]
            sent = f"{r['sent_bytes_per_step'] / 1e6:.2f} ({how})"
        lo = r["loopback_bytes_per_rank_step"]
        lo_s = "n/a" if lo is None else f"{lo / 1e6:.2f}"
        rm = "/".join(f"{t * 1e3:.0f}" for t in r["round_medians_s"])
        delta = "" if "loss_delta" not in r else (
            f"{r['loss_delta']:.1e} {'✓' if r['loss_ok'] else '✗'} (tol {r['loss_tol']:.0e})")
        lines.append(
            f"| {r['system']} ({r['label']}) | {r['memory_class']} | {r['precision']} | "
            f"{r['step_s'] * 1e3:.0f} | {rm} | {r['tokens_per_s']:,.0f} | "
            f"{_mb(r['peak_rss_bytes'])} | {_mb(r['peak_rss_bytes'] - r['base_rss_bytes'])} | "
            f"{sent} | {lo_s} | {r['final_loss']:.5f} | {delta} |")
    lines += ["", "Ratios: zerotrain / best peer of the same memory class and precision "
              "(≤ 1 means zerotrain wins; time and memory best peers chosen separately). "
              "Best-round ratio: fastest round median / the peers' fastest round median, "
              "a check that is blind to rounds slowed down by other load.", "",
              "| zerotrain | class | prec | best peer (time) | step-time ratio "
              "| best-round ratio | best peer (RSS) | peak-RSS ratio | Δ-RSS ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    for e in rat:
        if "time_ratio" not in e:
            lines.append(f"| {e['system']} | {e['memory_class']} | {e['precision']} | "
                         f"no peer ran ({', '.join(e['peers'])}) | | | | | |")
            continue
        dr = "n/a" if e["rss_delta_ratio"] is None else f"{e['rss_delta_ratio']:.2f}"
        lines.append(f"| {e['system']} | {e['memory_class']} | {e['precision']} | "
                     f"{e['best_time_peer']} | {e['time_ratio']:.2f} | "
                     f"{e['best_round_ratio']:.2f} ({e['best_round_peer']}) | "
                     f"{e['best_rss_peer']} | "
                     f"{e['rss_ratio']:.3f} | {dr} |")
    if ref_loss is not None:
        lines += ["", f"Reference final loss (DDP fp32): {ref_loss:.6f}. Tolerances: fp32 "
                  f"{TOL['fp32']:.0e}, bf16 {TOL['bf16']:.0e}."]
    return "\n".join(lines) + "\n"


def count_params(a: argparse.Namespace) -> int:
    from zerotrain.config import ModelConfig
    from zerotrain.models.gpt import GPT

    return GPT(ModelConfig(**PRESETS[a.model_size]["model"])).num_params()


def write_report(a: argparse.Namespace, meta: dict, runs: dict[str, list[dict]],
                 out_dir: Path) -> None:
    rows = {s: summarize(s, rs, a) for s, rs in runs.items()}
    ref_loss = add_loss_checks(rows)
    rat = ratios(rows)
    text = markdown(meta, a, rows, rat, ref_loss)
    print(text)
    settings = {k: v for k, v in vars(a).items() if k not in ("system_list", "report")}
    settings["systems"] = list(runs)
    settings["model"] = PRESETS[a.model_size]["model"]
    (out_dir / f"{a.name}.md").write_text(text)
    (out_dir / f"{a.name}.json").write_text(json.dumps(
        {"meta": meta, "settings": settings, "reference_final_loss": ref_loss,
         "tolerance": TOL, "rows": list(rows.values()), "ratios": rat,
         "runs": runs}, indent=1))


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.report:
        old = json.loads(Path(a.report).read_text())
        for k, v in old["settings"].items():
            if k not in ("name", "out_dir", "systems", "model"):
                setattr(a, k, v)
        write_report(a, old["meta"], old["runs"], Path(a.out_dir))
        return
    out_dir = Path(a.out_dir)
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    netns = a.netns == "on" or (a.netns == "auto" and netns_works())
    if a.netns == "on" and not netns_works():
        sys.exit("--netns on: `unshare -n` does not work here (needs root); use --netns off")
    data = out_dir / f"{a.name}_data.pt"
    make_data(a, data)
    meta = machine_info(a, netns)
    meta["params"] = count_params(a)
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {s: [] for s in a.system_list}
    total = len(a.system_list) * a.rounds
    k = 0
    for rnd in range(a.rounds):
        for s in a.system_list:
            k += 1
            r = run_one(a, s, rnd, data, netns, logs)
            runs[s].append(r)
            msg = (f"{statistics.median(r['step_times_s']) * 1e3:.0f} ms/step, final loss "
                   f"{r['final_loss']:.5f}" if r.get("ok") else f"FAILED: {r.get('error')}")
            print(f"[{k}/{total}] round {rnd} {s}: {msg} ({r['job_wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
    meta["wall_s"] = time.perf_counter() - t0
    meta["load_avg_end"] = os.getloadavg()
    write_report(a, meta, runs, out_dir)


if __name__ == "__main__":
    main()
