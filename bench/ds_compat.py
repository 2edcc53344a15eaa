"""zerotrain.deepspeed against real DeepSpeed: one script (bench/ds_script.py), run
under DeepSpeed 0.19.8 and with `import zerotrain.deepspeed as deepspeed`, 2 ranks on
CPU (gloo, fp32), ZeRO stages 0-3; per-step losses (rank 0) and the lr each update
applies, side by side.

    VENV=/tmp/venv-bench bash bench/setup_peers.sh      # once: the DeepSpeed venv
    /tmp/venv-bench/bin/python bench/ds_compat.py        # ~15 min on 2 busy cores
    /tmp/venv-bench/bin/python bench/ds_compat.py --stages 2 --cases config

Cases: `config` (AdamW + WarmupLR from the config, two param groups: no decay on
biases and norms, training_data), `cosine` (the same with WarmupCosineLR), `client`
(a client torch.optim.AdamW over the groups + a LambdaLR client scheduler), `clientcfg`
(a client AdamW beside a config `optimizer` block with another lr and betas: the client's
wins in both), `sgd`
(client SGD, Nesterov momentum, a group with its own lr), `init` (built under
zero.Init, rank 0 loads the weights inside GatheredParameters(modifier_rank=0); ZeRO-3
only: below it DeepSpeed's partitioned weights reach the forward and it fails),
`gathered` (as `config`; after `initialize` rank 0 writes head.bias inside
GatheredParameters(modifier_rank=0); the cell gives step 1's loss / the lrs, and how many
ranks see the edit after the block → after step 1 → at the end: DeepSpeed broadcasts
it at ZeRO-3 only and its next step restores its fp32 masters at ZeRO-1-3; zerotrain
keeps the edit on every rank, so later losses part by design),
`resume` (as `config`; DeepSpeed saves its checkpoint after 6 steps and goes on,
zerotrain.deepspeed loads DeepSpeed's folder into a fresh engine and continues: the
continuations are compared), `convert` (the same through `zerotrain convert
--from-deepspeed`, then zerotrain's own checkpoint; ZeRO-1-3: a ZeRO-0 folder with two
groups does not say which parameter is in which), `accum` (as `config`, with
gradient_accumulation_steps 2: the lr is read at every micro-step).
Writes bench/results/ds_compat.json and prints a Markdown table; exits 1 when a row
parts by more than --tol (relative).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = ("config", "cosine", "client", "clientcfg", "sgd", "init", "gathered", "resume",
         "convert", "accum")
SAVE_AT = 6  # `resume`: DeepSpeed saves here and goes on; zerotrain resumes from its files


def ds_config(stage: int, case: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6}
    if case == "accum":
        cfg["gradient_accumulation_steps"] = 2
    if case in ("config", "cosine", "clientcfg", "init", "gathered", "resume", "convert",
                "accum"):
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.999],
                                                        "eps": 1e-8, "weight_decay": 0.01}}
    if case in ("config", "init", "gathered", "resume", "convert", "accum"):
        cfg["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3, "warmup_num_steps": 4}}
    if case == "cosine":
        cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "total_num_steps": 12}}
    return cfg


def run(impl: str, stage: int, case: str, steps: int, tmp: Path, timeout: int) -> dict | str:
    cfg = tmp / f"ds_{stage}_{case}.json"
    cfg.write_text(json.dumps(ds_config(stage, case)))
    out = tmp / f"{impl}_{stage}_{case}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(HERE / "ds_script.py"), "--deepspeed", "--deepspeed_config", str(cfg),
           "--case", "config" if case in ("resume", "convert", "accum") else case,
           "--steps", str(steps),
           "--out", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DS_IMPL=impl)
    if case in ("resume", "convert"):
        ck = str(tmp / f"ck_{case}_{stage}")
        if impl == "deepspeed":
            cmd += ["--save", ck, "--save-at", str(SAVE_AT)]
        elif case == "resume":
            cmd += ["--load", ck]
        else:
            conv = subprocess.run([sys.executable, "-m", "zerotrain", "convert",
                                   "--from-deepspeed", ck, "--out", ck + "_zt"], env=env,
                                  capture_output=True, text=True, timeout=timeout)
            if conv.returncode:
                return f"convert: {conv.stderr.strip().splitlines()[-1]}"
            cmd += ["--load", ck + "_zt"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out"
    # both may abort at interpreter exit (gloo threads); the result file is what counts
    if not out.is_file():
        tail = [ln for ln in proc.stderr.splitlines() if "Error" in ln][-1:]
        return f"failed: {tail[0] if tail else proc.returncode}"
    return json.loads(out.read_text())


WHAT = {
    "config": "AdamW + WarmupLR from the config; two param groups (no decay on biases, "
              "norms); `training_data`",
    "cosine": "the same with WarmupCosineLR",
    "accum": "`config` with `gradient_accumulation_steps: 2`",
    "client": "client `torch.optim.AdamW` over the two groups + client `LambdaLR`",
    "clientcfg": "client `torch.optim.AdamW` (lr 7e-4, betas 0.8/0.95) and a config "
                 "`optimizer` block (AdamW, lr 2e-3): the client's must win",
    "sgd": "client `torch.optim.SGD` (Nesterov momentum), one group with its own lr",
    "init": "`zero.Init`; rank 0 loads the weights in `GatheredParameters(modifier_rank=0)` "
            "before `initialize` (DeepSpeed's works at ZeRO-3 only)",
    "gathered": "`config`; after `initialize` rank 0 writes head.bias inside "
                "`GatheredParameters(modifier_rank=0)`; ranks seeing the edit after the "
                "block → step 1 → step 12",
    "resume": "DeepSpeed saves at step 6 and goes on; zerotrain loads DeepSpeed's folder "
              "into a fresh engine and goes on (steps 7-12 compared)",
    "convert": "the same through `zerotrain convert --from-deepspeed` and zerotrain's own "
               "checkpoint",
}


EDIT = [2.0, -2.0, 1.0, -1.0]  # what ds_script.py's `gathered` writes into head.bias


def edit_fate(probe: dict[str, Any]) -> str:
    """`gathered`: how many ranks see rank 0's edit of head.bias right after the block,
    after step 1 and at the end, e.g. "2/2→0/2→0/2" (an Adam step moves a bias by at
    most the lr, far less than the edit's distance from the initial values)."""
    def seen(per_rank: list[list[float]]) -> str:
        n = sum(max(abs(x - e) for x, e in zip(b, EDIT)) < 0.5 for b in per_rank)
        return f"{n}/{len(per_rank)}"
    return "→".join(seen(probe[k]) for k in ("after_edit", "after_step1", "end"))


CLIENT_LR, CONFIG_LR = 7e-4, 2e-3  # `clientcfg`: the client optimizer's lr, the config's


def judge_case(row: dict[str, Any], ds: dict, zt: dict, tol: float) -> None:
    """What a case checks beyond the losses and lrs agreeing."""
    if row["case"] == "gathered":
        judge_gathered(row, ds, zt, tol)
    elif row["case"] == "clientcfg":  # the lr applied says whose optimizer runs
        row["lr_applied"] = {"deepspeed": ds["lrs"][0][0], "zerotrain": zt["lrs"][0][0]}
        row["ok"] = row["ok"] and abs(ds["lrs"][0][0] - CLIENT_LR) < 1e-12


def judge_gathered(row: dict[str, Any], ds: dict, zt: dict, tol: float) -> None:
    """`gathered` differs by design after step 1: DeepSpeed's next step writes its fp32
    masters (copied at `initialize`, before the edit) back over the edit at ZeRO-1-3, and
    below ZeRO-3 the edit reaches no other rank; zerotrain makes the edit every rank's
    master weights. The row passes when the first step agrees (both forward the edited
    weights on rank 0), the lrs agree, and zerotrain keeps the edit on every rank to the
    end."""
    row["edit"] = {"deepspeed": edit_fate(ds["probe"]), "zerotrain": edit_fate(zt["probe"])}
    row["first_loss_rel"] = rel(zt["losses"][0], ds["losses"][0])
    kept = "→".join([f"{len(zt['probe']['end'])}/{len(zt['probe']['end'])}"] * 3)
    row["ok"] = (row["first_loss_rel"] <= tol and row["lr_rel"] <= tol
                 and row["edit"]["zerotrain"] == kept)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per case, one column per ZeRO stage (docs/from-deepspeed.md)."""
    by = {(r["case"], r["stage"]): r for r in rows}

    def num(x: float) -> str:
        return "0" if x == 0 else f"{x:.1e}"

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "—"
        if "error" in r:
            return r["error"]
        text = f"{num(r['loss_rel'])} / {num(r['lr_rel'])}"
        if "lr_applied" in r:
            text += (f"; lr applied {r['lr_applied']['deepspeed']:g} / "
                     f"{r['lr_applied']['zerotrain']:g} (client {CLIENT_LR:g}, config "
                     f"{CONFIG_LR:g})")
        if "edit" in r:  # the loss parts by design after step 1: say where the edit went
            text = (f"step 1: {num(r['first_loss_rel'])} / {num(r['lr_rel'])}; ranks seeing "
                    f"the edit: DS {r['edit']['deepspeed']}, zt {r['edit']['zerotrain']}")
        return text
    lines = ["| case | script | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |", "|---|---|---|---|---|---|"]
    for case in [c for c in WHAT if any(k[0] == c for k in by)]:
        lines.append(f"| {case} | {WHAT[case]} | "
                     + " | ".join(cell(by.get((case, s))) for s in range(4)) + " |")
    return "\n".join(lines)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tol", type=float, default=2e-4)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=str(HERE / "results" / "ds_compat.json"))
    p.add_argument("--update", action="store_true",
                   help="keep --out's other rows; replace only the rows run now")
    a = p.parse_args()
    import deepspeed
    import torch

    rows: list[dict[str, Any]] = []
    if a.update and Path(a.out).is_file():
        rows = json.loads(Path(a.out).read_text())["rows"]

    def write() -> None:  # after every row: a long run that stops keeps what it measured
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "deepspeed": deepspeed.__version__, "torch": torch.__version__, "steps": a.steps,
            "tol": a.tol, "world_size": 2, "rows": rows}, indent=1))

    with tempfile.TemporaryDirectory() as d:
        for case in a.cases.split(","):
            for stage in map(int, a.stages.split(",")):
                if (case, stage) in (("init", 0), ("init", 1), ("init", 2), ("convert", 0)):
                    continue  # DeepSpeed's zero.Init works at ZeRO-3 only; see `convert`
                ds = run("deepspeed", stage, case, a.steps, Path(d), a.timeout)
                zt = run("zerotrain", stage, case, a.steps, Path(d), a.timeout)
                row: dict[str, Any] = {"stage": stage, "case": case}
                if (not isinstance(ds, str) and not isinstance(zt, str)
                        and case in ("resume", "convert")):
                    # DeepSpeed's own continuation is the reference
                    ds = {**ds, "losses": ds["losses"][SAVE_AT:], "lrs": ds["lrs"][SAVE_AT:]}
                if (not isinstance(ds, str) and not isinstance(zt, str)
                        and [len(g) for g in ds["lrs"]] != [len(g) for g in zt["lrs"]]):
                    zt = (f"{len(zt['lrs'])} steps × {len(zt['lrs'][0])} groups where DeepSpeed "
                          f"ran {len(ds['lrs'])} × {len(ds['lrs'][0])}")
                if isinstance(ds, str) or isinstance(zt, str):
                    row.update(error=f"deepspeed: {ds}" if isinstance(ds, str)
                               else f"zerotrain: {zt}")
                else:
                    row.update(
                        deepspeed=ds, zerotrain=zt,
                        loss_rel=max(map(rel, zt["losses"], ds["losses"])),
                        lr_rel=max(rel(x, y) for zs, ds_ in zip(zt["lrs"], ds["lrs"], strict=True)
                                   for x, y in zip(zs, ds_, strict=True)),
                        final_loss=(ds["losses"][-1], zt["losses"][-1]))
                    row["ok"] = row["loss_rel"] <= a.tol and row["lr_rel"] <= a.tol
                    judge_case(row, ds, zt, a.tol)
                rows = [r for r in rows if (r["case"], r["stage"]) != (case, stage)] + [row]
                write()
                print(json.dumps({k: v for k, v in row.items()
                                  if k not in ("deepspeed", "zerotrain")}), flush=True)
    print(f"\n{table(rows)}\n\nEach cell: largest relative difference in the loss / in "
          "the lr each update applied (read from `optimizer.param_groups` before "
          f"`engine.step()`), over the {a.steps} steps; the bar is {a.tol:g}. DeepSpeed "
          f"{deepspeed.__version__}, torch {torch.__version__}, 2 ranks, gloo on CPU, fp32.")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
