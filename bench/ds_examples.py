"""Four DeepSpeedExamples scripts (their CPU-runnable stand-ins, bench/ds_examples/: the
same DeepSpeed calls in the same order, stand-in data instead of downloads) run under
DeepSpeed 0.19.8 (`torchrun`) and under `zerotrain launch` side by side, 2 ranks, CPU,
fp32. The scripts are unchanged between the two: `zerotrain launch` resolves their
`import deepspeed` (and `from deepspeed.accelerator ...`, `from deepspeed.moe.utils ...`,
`from deepspeed import comm`) to zerotrain.deepspeed.

Rows: cifar (ZeRO-1 and -2: training_data, config Adam + WarmupLR, eval through the
engine, save_checkpoint), bert (HelloDeepSpeed: ZeRO-1 + CPU offload, engine.parameters(),
save_checkpoint with client_state, then a second run resuming from step 4 with
load_checkpoint, also from DeepSpeed's own folder), gan (two engines, client Adam beside a
config optimizer, two backward passes before a step), zenflow (finetune_llama: an HF Llama,
a datasets.Dataset as training_data; its zf_config.json without the `zenflow` block and in
fp32 for the numbers; with it, zerotrain's refusal).

    .venv-bench/bin/python bench/ds_examples.py      # writes bench/results/ds_examples.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EX = HERE / "ds_examples"
SRC = HERE.parent / "src"

ZF_CONFIG = {  # DeepSpeedExamples' zf_config.json
    "train_batch_size": 8, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "zenflow": {"topk_ratio": 0.1, "update_interval": 4,
                                      "full_warm_up_rounds": 0, "overlap_step": True}},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "zero_allow_untested_optimizer": True}


def run(impl: str, script: str, out: Path, args: list[str], timeout: int = 1200
        ) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    argv = [str(EX / script), "--out", str(out), *args]
    if impl == "deepspeed":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", *argv]
    else:
        env["PYTHONPATH"] = f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, "-m", "zerotrain", "launch", "--nproc", "2", *argv]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "output.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"failed": (proc.stdout + proc.stderr)[-1500:]}
    return json.loads((out / "rank0.json").read_text())


def rel(a: list[float], b: list[float]) -> float | str:
    if len(a) != len(b):
        return f"lengths {len(a)} vs {len(b)}"
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def side(script: str, root: Path, tag: str, args: list[str], keys=("losses",)) -> dict:
    ds = run("deepspeed", script, root / f"{tag}-ds", args)
    zt = run("zerotrain", script, root / f"{tag}-zt", args)
    if "failed" in ds or "failed" in zt:
        return {"deepspeed": ds, "zerotrain": zt}
    row = {k: rel(zt[k], ds[k]) for k in keys}
    row.update(steps=len(ds["losses"]), first_loss=ds["losses"][0])
    return {**row, "extra": {k: (ds[k], zt[k]) for k in ds if k not in ("losses", "lossG")}}


def bert(root: Path) -> dict:
    out = side("bert.py", root, "bert", ["--steps", "8"])
    half = {i: run(i, "bert.py", root / f"bert-half-{i}", ["--steps", "4"])
            for i in ("deepspeed", "zerotrain")}
    ck = {i: str(root / f"bert-half-{i}" / "ckpt") for i in half}
    ds_res = run("deepspeed", "bert.py", root / "bert-res-ds",
                 ["--steps", "8", "--load_checkpoint_dir", ck["deepspeed"]])
    zt_res = run("zerotrain", "bert.py", root / "bert-res-zt",
                 ["--steps", "8", "--load_checkpoint_dir", ck["zerotrain"]])
    zt_mig = run("zerotrain", "bert.py", root / "bert-res-zt-from-ds",
                 ["--steps", "8", "--load_checkpoint_dir", ck["deepspeed"]])
    full = json.loads((root / "bert-ds" / "rank0.json").read_text())["losses"][4:] \
        if (root / "bert-ds" / "rank0.json").is_file() else []
    for name, r in (("resume_deepspeed", ds_res), ("resume_zerotrain", zt_res),
                    ("resume_zerotrain_from_deepspeed_folder", zt_mig)):
        out[name] = r if "failed" in r else rel(r["losses"], full)
    return out


def zenflow(root: Path) -> dict:
    plain = json.loads(json.dumps(ZF_CONFIG))
    del plain["zero_optimization"]["zenflow"]
    plain["bf16"]["enabled"] = False
    for name, cfg in (("zf_plain.json", plain), ("zf_config.json", ZF_CONFIG)):
        (root / name).write_text(json.dumps(cfg))
    out = side("zenflow_llama.py", root, "zenflow",
               ["--steps", "6", "--deepspeed_config", str(root / "zf_plain.json")])
    refused = run("zerotrain", "zenflow_llama.py", root / "zenflow-asis-zt",
                  ["--steps", "2", "--deepspeed_config", str(root / "zf_config.json")])
    text = (root / "zenflow-asis-zt" / "output.txt").read_text()
    out["as_is_zerotrain"] = next((ln.strip() for ln in text.splitlines()
                                   if "does not implement" in ln), refused)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/ds_examples")
    ap.add_argument("--only", default="cifar,bert,gan,zenflow")
    ap.add_argument("--out", default=str(HERE / "results" / "ds_examples.json"))
    a = ap.parse_args()
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}
    for name in a.only.split(","):
        if name == "cifar":
            for stage in (1, 2):
                rows[f"cifar-z{stage}"] = side("cifar.py", root, f"cifar-z{stage}",
                                               ["--stage", str(stage), "--steps", "10"])
        elif name == "bert":
            rows["bert"] = bert(root)
        elif name == "gan":
            rows["gan"] = side("gan.py", root, "gan", ["--steps", "8"],
                               keys=("losses", "lossG"))
        elif name == "zenflow":
            rows["zenflow"] = zenflow(root)
        print(json.dumps({k: v for k, v in rows.items() if k.startswith(name)}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
