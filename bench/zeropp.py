"""ZeRO++ (hpZ, qwZ, qgZ) against ZeRO-3: cross-node bytes, loss, step time, peak.

Run: .venv/bin/python bench/zeropp.py [--steps 420] [--models main,llama-60m]
Prints a Markdown table and writes bench/results/zeropp.json (+ docs/zeropp.png).

Each row is one `zerotrain train` run of the main job (configs/default.yaml, the
embedded corpus) at ZeRO-3 on 4 gloo ranks cut into 2 emulated nodes of 2
(`--comm.node_size 2`): plain, +hpZ (`zero.secondary_partition 2`), +qwZ
(`zero.param_wire int8`), +qgZ (`zero.grad_wire int4`) and all three. The bytes are the
comm layer's own counters of the last logged step on rank 0 (`bytes_sent`, and of them
`inter_node_bytes_sent`: to ranks of the other node; native collectives are counted as
exchanging equal shares with every peer); the validation loss is the run's last
evaluation; step time is the median logged step; peak is rank 0's process peak RSS
(the CPU stand-in for device memory). `--steps 20` gives the bytes in a minute; the
quality claim needs the full 420 steps.
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


def run(model: str, name: str, steps: int, out: Path) -> dict:
    run_dir = out / f"{model}-{name.replace(' ', '_').replace('+', '')}"
    cmd = [
        sys.executable,
        "-m",
        "zerotrain",
        "train",
        "--config",
        str(ROOT / "configs" / "default.yaml"),
        "--nproc",
        "4",
        "--comm.node_size",
        "2",
        "--zero.stage",
        "3",
        "--train.steps",
        str(steps),
        "--logging.run_dir",
        str(run_dir),
        "--logging.overwrite",
        "true",
        "--checkpoint.every",
        "0",
        "--schedule.warmup_steps",
        str(min(40, steps // 4)),
        "--logging.eval_every",
        str(max(1, steps // 4)),
        *MODELS[model],
        *OPTIONS[name],
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {"model": model, "option": name, "error": proc.stderr.strip().splitlines()[-1:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("type") == "train"]
    val = [r for r in recs if r.get("type") == "val"]
    peak = [r for r in recs if "peak_rss_bytes" in r or r.get("type") == "phases"]
    return {
        "model": model,
        "option": name,
        "steps": steps,
        "bytes_sent": train[-1]["bytes_sent"],
        "inter_node_bytes_sent": train[-1]["inter_node_bytes_sent"],
        "val_loss": val[-1]["val_loss"] if val else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in train[1:] or train),
        "peak": peak[-1] if peak else None,
        "wall_s": time.time() - t0,
    }


def table(rows: list[dict]) -> str:
    out = [
        "| model | option | inter-node MB/step | × ZeRO-3 | intra-node MB/step | "
        "val loss | Δ loss | step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["model"]: r for r in rows if r["option"] == "ZeRO-3" and "error" not in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['option']} | failed: {r['error']} |||||||")
            continue
        b = base.get(r["model"])
        inter, total = r["inter_node_bytes_sent"], r["bytes_sent"]
        ratio = inter / b["inter_node_bytes_sent"] if b else float("nan")
        dl = (
            (r["val_loss"] / b["val_loss"] - 1)
            if b and r["val_loss"] and b["val_loss"]
            else float("nan")
        )
        vl = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "–"
        out.append(
            f"| {r['model']} | {r['option']} | {inter / 1e6:.2f} | {ratio:.3f} | "
            f"{(total - inter) / 1e6:.2f} | {vl} | {dl:+.2%} | "
            f"{r['step_time_s']:.3f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--models", default="main")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--out", default=str(ROOT / "runs" / "zeropp"))
    a = ap.parse_args()
    rows = [
        run(m, o, a.steps, Path(a.out)) for m in a.models.split(",") for o in a.options.split(",")
    ]
    print(table(rows))
    res = HERE / "results"
    res.mkdir(exist_ok=True)
    (res / "zeropp.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
