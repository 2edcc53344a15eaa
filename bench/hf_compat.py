"""Hugging Face Trainer and TRL SFTTrainer on zerotrain against real DeepSpeed 0.19.8:
one unchanged script (bench/hf_script.py: a random-weight Llama loaded with
from_pretrained, a local dataset, 30 steps, a save at step 15), run with `torchrun`
under DeepSpeed and with `zerotrain launch` (which resolves the script's, transformers'
and Accelerate's `import deepspeed` to zerotrain.deepspeed), 2 ranks on CPU, fp32,
ZeRO-2 and ZeRO-3.

Per (script, stage): the per-step losses and learning rates side by side; the weights
`save_model` writes; zerotrain resumed from its own checkpoint-15 (2 ranks, and 1 rank
with twice the accumulation: the same global batches) and from DeepSpeed's
checkpoint-15 (global_step15/), each against the uninterrupted run; and the peak host
RSS per rank during from_pretrained.

    bash bench/setup_peers.sh                     # the DeepSpeed venv (.venv-bench)
    .venv-bench/bin/python -m pip install torch==2.13.0 transformers==5.24.0 \
        accelerate==1.16.0 trl==1.16.0 datasets==5.2.0
    .venv-bench/bin/python bench/hf_compat.py     # writes bench/results/hf_compat.json
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
SRC = HERE.parent / "src"
SCRIPT = HERE / "hf_script.py"
STEPS, SAVE = 30, 15


def ds_config(stage: int) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": stage}
    if stage == 3:
        z["stage3_gather_16bit_weights_on_model_save"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": z}


def launch(impl: str, out: Path, cfg: Path, kind: str, model: Path, nproc: int = 2,
           gas: int = 2, resume: Path | None = None, timeout: int = 1800) -> dict:
    """One run; its rank-0 result (log, from_pretrained RSS) plus every rank's RSS."""
    args = [str(out), "--ds", str(cfg), "--kind", kind, "--steps", str(STEPS),
            "--save-steps", str(SAVE), "--model", str(model), "--gas", str(gas)]
    if resume is not None:
        args += ["--resume", str(resume)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    if impl == "deepspeed":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(SCRIPT), *args]
    else:
        env["PYTHONPATH"] = f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, "-m", "zerotrain", "launch", "--nproc", str(nproc),
               str(SCRIPT), *args]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "output.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} {out.name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    ranks = [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(nproc)]
    return {**ranks[0], "rss_ranks": [r["from_pretrained_rss"] for r in ranks]}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(mine: list[dict], ref: list[dict], from_step: int = 0) -> dict[str, Any]:
    """Largest relative difference of loss and lr over the steps both logged."""
    ref_at = {r["step"]: r for r in ref}
    rows = [(m, ref_at[m["step"]]) for m in mine if m["step"] in ref_at and
            m["step"] > from_step]
    if not rows:
        return {"steps": 0}
    return {"steps": len(rows), "loss": max(rel(m["loss"], r["loss"]) for m, r in rows),
            "lr": max(rel(m["lr"], r["lr"]) if r["lr"] else abs(m["lr"]) for m, r in rows)}


def weights_diff(a: Path, b: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if set(x) != set(y):
        return {"keys_differ": sorted(set(x) ^ set(y))}
    diff = max(float((x[k].double() - y[k].double()).abs().max()) for k in x)
    return {"tensors": len(x), "max_abs": diff, "equal": all(
        bool((x[k] == y[k]).all()) for k in x), "bytes": (a / "model.safetensors").stat().st_size}


def loads_back(folder: Path, ref: Path) -> bool:
    """save_model's folder loads with from_pretrained and holds the saved weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    saved = load_file(ref / "model.safetensors")
    sd = m.state_dict()
    return all(torch.equal(sd[k], v) for k, v in saved.items())


def case(kind: str, stage: int, root: Path, model: Path) -> dict[str, Any]:
    cfg = root / f"z{stage}.json"
    cfg.write_text(json.dumps(ds_config(stage)))
    tag = f"{kind}-z{stage}"
    ds = launch("deepspeed", root / f"{tag}-ds", cfg, kind, model)
    zt = launch("zerotrain", root / f"{tag}-zt", cfg, kind, model)
    ck_zt = root / f"{tag}-zt" / "run" / f"checkpoint-{SAVE}"
    ck_ds = root / f"{tag}-ds" / "run" / f"checkpoint-{SAVE}"
    res = launch("zerotrain", root / f"{tag}-zt-resume", cfg, kind, model, resume=ck_zt)
    one = launch("zerotrain", root / f"{tag}-zt-resume-1rank", cfg, kind, model, nproc=1,
                 gas=4, resume=ck_zt)
    mig = launch("zerotrain", root / f"{tag}-zt-from-ds", cfg, kind, model, resume=ck_ds)
    return {
        "vs_deepspeed": compare(zt["log"], ds["log"]),
        "save_model": weights_diff(root / f"{tag}-zt" / "final", root / f"{tag}-ds" / "final"),
        "save_model_loads": loads_back(root / f"{tag}-zt" / "final", root / f"{tag}-zt" / "final"),
        "resume_own": compare(res["log"], zt["log"], SAVE),
        "resume_1rank": compare(one["log"], zt["log"], SAVE),
        "resume_from_deepspeed": compare(mig["log"], ds["log"], SAVE),
        "rss_from_pretrained": {"deepspeed": ds["rss_ranks"], "zerotrain": zt["rss_ranks"]},
        "losses": {"deepspeed": [r["loss"] for r in ds["log"]],
                   "zerotrain": [r["loss"] for r in zt["log"]]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="trainer,sft")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--work", default="/tmp/hf_compat")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "hf_compat.json"))
    ap.add_argument("--rss-only", action="store_true",
                    help="only the host RSS of from_pretrained at ZeRO-3, on a larger Llama "
                         "(hidden 512, 4 layers, vocabulary 32000: 43M parameters, 172 MB)")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import hf_script

    root = Path(a.work)
    if a.rss_only:
        big = root / "llama-rss"
        hf_script.make_model_dir(big, 32000, 512, 4)
        cfg = root / "z3.json"
        cfg.write_text(json.dumps(ds_config(3)))
        global STEPS, SAVE
        STEPS, SAVE = 1, 100
        rss = {impl: launch(impl, root / f"rss-{impl}", cfg, "trainer", big)["rss_ranks"]
               for impl in ("deepspeed", "zerotrain")}
        print(json.dumps({"rss_from_pretrained_zero3_43M": rss}))
        Path(a.out).write_text(json.dumps({"rss_from_pretrained_zero3_43M": rss}))
        return
    model = root / f"llama-h{a.hidden}"
    hf_script.make_model_dir(model, 256, a.hidden, 2)
    results = {}
    for kind in a.kinds.split(","):
        for stage in (int(s) for s in a.stages.split(",")):
            results[f"{kind}-z{stage}"] = r = case(kind, stage, root, model)
            print(json.dumps({f"{kind}-z{stage}": {k: v for k, v in r.items()
                                                    if k != "losses"}}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
