"""ZeRO++ (hpZ, qwZ, qgZ) against ZeRO-3: cross-node bytes, loss, step time, peak.

Run: .venv/bin/python bench/zeropp.py [--steps 420] [--models main,llama-60m]
     [--options "ZeRO-3,+hpZ"] [--table]
Prints a Markdown table, writes bench/results/zeropp.json and draws docs/zeropp.png.

Each row is one `zerotrain train` run of the main job (configs/default.yaml, the
embedded corpus) at ZeRO-3 on 4 gloo ranks cut into 2 emulated nodes of 2
(`--comm.node_size 2`): plain, +hpZ (`zero.secondary_partition 2`), +qwZ
(`zero.param_wire int8`), +qgZ (`zero.grad_wire int4`) and all three. The bytes are the
comm layer's own counters of the last logged step on rank 0 (`bytes_sent`, and of them
`inter_node_bytes_sent`: to ranks of the other node; native collectives are counted as
exchanging equal shares with every peer); the validation loss is the run's last
evaluation; step time is the median logged step; peak is the memory audit's
(`memory_phases`, rank 0; the ranks hold equal shards): the largest of the forward,
backward and step peaks above the process's start, measured and as the memory model
predicts it. `--steps 20` gives the bytes in a minute; the quality claim needs the
full 420 steps.

Every run keeps its directory (runs/zeropp/<model>-<option>, metrics.jsonl); `--table`
runs nothing and tabulates the runs already there (of `--steps` steps), so options run
one at a time (a shared machine) come together in one table and one plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

OPTIONS = {
    "ZeRO-3": [],
    "+hpZ": ["--zero.secondary_partition", "2"],
    "+qwZ": ["--zero.param_wire", "int8"],
    "+qgZ": ["--zero.grad_wire", "int4"],
    "all three": [
        "--zero.secondary_partition",
        "2",
        "--zero.param_wire",
        "int8",
        "--zero.grad_wire",
        "int4",
    ],
}
MODELS = {
    "main": [],
    "llama-60m": [
        "--model.preset",
        "llama-60m",
        "--model.block_size",
        "128",
        "--data.micro_batch_size",
        "2",
    ],
}
#: the phases of a training step whose peak the table reports (not init, not save)
STEP_PHASES = ("forward", "backward", "step")
MIB = 2**20


def run_dir(out: Path, model: str, name: str) -> Path:
    return out / f"{model}-{name.replace(' ', '_').replace('+', '')}"


def run(model: str, name: str, steps: int, out: Path) -> dict:
    """Train one option of one model; its row (or the error's last line)."""
    where = run_dir(out, model, name)
    cmd = [
        sys.executable, "-m", "zerotrain", "train",
        "--config", str(ROOT / "configs" / "default.yaml"),
        "--nproc", "4", "--comm.node_size", "2", "--zero.stage", "3",
        "--train.steps", str(steps), "--logging.run_dir", str(where),
        "--logging.overwrite", "true", "--checkpoint.every", "0",
        "--schedule.warmup_steps", str(min(40, steps // 4)),
        "--logging.eval_every", str(max(1, steps // 4)),
        *MODELS[model], *OPTIONS[name],
    ]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {"model": model, "option": name, "error": proc.stderr.strip().splitlines()[-1:]}
    return {**collect(model, name, where, steps), "wall_s": time.time() - t0}


def collect(model: str, name: str, where: Path, steps: int) -> dict:
    """A finished run's row, read from its metrics.jsonl."""
    path = where / "metrics.jsonl"
    if not path.exists():
        return {"model": model, "option": name, "error": [f"no run at {where}"]}
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    train = [r for r in recs if r.get("type") == "train"]
    val = [r for r in recs if r.get("type") == "val"]
    phases = [r for r in recs if r.get("type") == "memory_phases"]
    if not train or train[-1]["step"] != steps:
        done = train[-1]["step"] if train else 0
        return {"model": model, "option": name, "error": [f"{where}: {done} of {steps} steps"]}
    row = {
        "model": model,
        "option": name,
        "steps": steps,
        "bytes_sent": train[-1]["bytes_sent"],
        "inter_node_bytes_sent": train[-1]["inter_node_bytes_sent"],
        "val_loss": val[-1]["val_loss"] if val else None,
        "val_curve": [(r["step"], r["val_loss"]) for r in val],
        "step_time_s": statistics.median(r["step_time_s"] for r in train[1:] or train),
    }
    if phases:
        last = phases[-1]
        for kind in ("measured", "predicted"):
            row[f"peak_{kind}_bytes"] = max(last[kind].get(p, 0) for p in STEP_PHASES)
    return row


def _mib(row: dict, kind: str) -> str:
    v = row.get(f"peak_{kind}_bytes")
    return "–" if v is None else f"{v / MIB:.1f}"


def table(rows: list[dict]) -> str:
    out = [
        "| model | option | inter-node MB/step | × ZeRO-3 | intra-node MB/step | "
        "val loss | Δ loss | step s | peak MiB (measured / predicted) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["model"]: r for r in rows if r["option"] == "ZeRO-3" and "error" not in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['option']} | failed: {r['error']} ||||||||")
            continue
        b = base.get(r["model"])
        inter, total = r["inter_node_bytes_sent"], r["bytes_sent"]
        ratio = inter / b["inter_node_bytes_sent"] if b else float("nan")
        has = b and r["val_loss"] and b["val_loss"]
        dl = (r["val_loss"] / b["val_loss"] - 1) if has else float("nan")
        vl = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "–"
        out.append(
            f"| {r['model']} | {r['option']} | {inter / 1e6:.2f} | {ratio:.3f} | "
            f"{(total - inter) / 1e6:.2f} | {vl} | {dl:+.2%} | {r['step_time_s']:.3f} | "
            f"{_mib(r, 'measured')} / {_mib(r, 'predicted')} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Per model: inter- and intra-node MB per step per option, and each evaluation's
    validation loss against plain ZeRO-3's at the same step (the band: ± 1%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows if "error" not in r})
    if not models:
        return
    fig, axes = plt.subplots(len(models), 2, figsize=(9, 3.2 * len(models)), squeeze=False)
    for (ax_b, ax_l), model in zip(axes, models, strict=True):
        ok = [r for r in rows if r["model"] == model and "error" not in r]
        names = [r["option"] for r in ok]
        inter = [r["inter_node_bytes_sent"] / 1e6 for r in ok]
        intra = [(r["bytes_sent"] - r["inter_node_bytes_sent"]) / 1e6 for r in ok]
        ax_b.bar(names, inter, color="tab:red", label="inter-node")
        ax_b.bar(names, intra, bottom=inter, color="tab:blue", alpha=0.5, label="intra-node")
        for i, v in enumerate(inter):
            ax_b.text(i, v, f"{v / inter[0]:.2f}×" if inter[0] else "", ha="center",
                      va="bottom", fontsize=8)  # fmt: skip
        ax_b.set_ylabel("MB sent per step (rank 0)")
        ax_b.set_title(f"{model}: bytes per step, 2 nodes × 2 ranks", fontsize=9)
        ax_b.legend(fontsize=8)
        ax_b.tick_params(axis="x", labelsize=8)
        base = dict(next((r["val_curve"] for r in ok if r["option"] == "ZeRO-3"), []))
        for r in ok:
            pts = [(s, 100 * (v / base[s] - 1)) for s, v in r["val_curve"] if base.get(s)]
            if pts:
                ax_l.plot(*zip(*pts, strict=True), marker="o", ms=3, label=r["option"])
        ax_l.axhspan(-1, 1, color="grey", alpha=0.2, label="± 1%")
        ax_l.set_xlabel("step")
        ax_l.set_ylabel("val loss vs ZeRO-3 (%)")
        ax_l.set_title(f"{model}: validation loss against plain ZeRO-3", fontsize=9)
        ax_l.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--models", default="main")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--out", default=str(ROOT / "runs" / "zeropp"))
    ap.add_argument("--table", action="store_true", help="tabulate the runs already in --out")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "zeropp.png"))
    a = ap.parse_args()
    out = Path(a.out)
    rows = [
        collect(m, o, run_dir(out, m, o), a.steps) if a.table else run(m, o, a.steps, out)
        for m in a.models.split(",")
        for o in a.options.split(",")
    ]
    print(table(rows))
    res = HERE / "results"
    res.mkdir(exist_ok=True)
    (res / "zeropp.json").write_text(json.dumps(rows, indent=1, default=str))
    if a.plot:
        plot(rows, Path(a.plot))


if __name__ == "__main__":
    main()
