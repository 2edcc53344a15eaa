"""On a real GPU (`pytest -m gpu`; skipped without CUDA; run by bench/gpu_check.sh).

One GPU: world size 1 for every stage and Offload (hooks, gathers and host copies all
run), against the same training on the CPU; Offload's host states pinned; the CLI's
sample and resume. Two or more GPUs: the CLI over NCCL at every stage's hardest case
(ZeRO-3, and the ring under ZeRO-2), and --nproc above the GPU count as one error.
Tolerances: fp32 with TF32 off differs from the CPU only in reduction order (1e-4
relative on the parameters); CUDA kernels are not bit-reproducible run to run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[1]

CASES = [
    {"zero": {"stage": 0}},
    {"zero": {"stage": 1}},
    {"zero": {"stage": 2}},
    {"zero": {"stage": 3}},
    {"zero": {"stage": 2, "offload_optimizer": "cpu"}},
    {"zero": {"stage": 3, "offload_optimizer": "cpu"}},
]


def _train(overrides: dict, device: str, steps: int = 6) -> dict:
    from zerotrain.config import deep_merge
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import batches, full_params, make_config

    # TF32 off and a small lr: GPU and CPU then differ by reduction order only, and Adam
    # does not turn that noise into full ±lr steps on near-zero gradients
    over = deep_merge(overrides, {"precision": {"tf32": False}, "train": {"device": device},
                                  "optimizer": {"lr": 2e-3}})
    cfg = make_config(over, 1, steps)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg)
    losses = []
    for X, Y in batches(steps):
        loss = eng(X.to(eng.device), Y.to(eng.device))
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    out = {"params": {k: v.cpu() for k, v in full_params(eng).items()}, "losses": losses,
           "device": str(eng.device), "comm_device": str(eng.comm.device)}
    if eng.strategy.offload:
        out["pinned"] = all(u.master.is_pinned() for u in eng.strategy.units)
    eng.close()
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c["zero"].values())))
def test_one_gpu_every_stage_equals_the_cpu(case):
    gpu, cpu = _train(case, "cuda"), _train(case, "cpu")
    assert gpu["device"].startswith("cuda")
    for name, p in cpu["params"].items():
        err = float((gpu["params"][name] - p).norm() / (p.norm() + 1e-30))
        assert err <= 1e-4, (name, err)
    if "pinned" in gpu:
        assert gpu["pinned"], "Offload's host states must be pinned on a GPU machine"


def test_generation_uses_a_generator_on_the_gpu():
    from zerotrain.config import build_config
    from zerotrain.data.tokenizer import load_tokenizer
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT
    from zerotrain.run.loop import generate_text

    cfg = build_config({"model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                        "zero": {"stage": 3}, "train": {"device": "cuda"}})
    eng = Engine(GPT(cfg.model), cfg)
    tok = load_tokenizer("bytes")
    a = generate_text(eng, tok, "def ", 12, seed=3)
    b = generate_text(eng, tok, "def ", 12, seed=3)
    assert a == b and a.startswith("def ")
    eng.close()


def _cli(tmp: Path, run: str, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "zerotrain", "train", "--model.n_layer", "2",
            "--model.n_embd", "64", "--model.n_head", "2", "--model.block_size", "64",
            "--data.path", str(ROOT / "README.md"), "--data.micro_batch_size", "4",
            "--schedule.kind", "constant", "--schedule.warmup_steps", "0",
            "--train.device", "cuda", "--logging.progress", "false", "--logging.plot",
            "false", "--logging.eval_every", "3", "--checkpoint.every", "3",
            "--comm.timeout_s", "60", "--logging.run_dir", str(tmp / run), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def _summary(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["type"] == "summary"
    return recs[-1]


def test_one_gpu_cli_sample_and_resume(tmp_path):
    full = _cli(tmp_path, "full", "--train.steps", "6", "--zero.stage", "3",
                "--zero.offload_optimizer", "cpu", "--logging.sample_tokens", "16")
    assert full.returncode == 0, full.stderr[-3000:]
    assert (tmp_path / "full" / "sample.txt").read_text().startswith("def ")
    part = _cli(tmp_path, "part", "--train.steps", "3", "--zero.stage", "3",
                "--zero.offload_optimizer", "cpu", "--logging.sample_tokens", "0")
    assert part.returncode == 0, part.stderr[-3000:]
    resumed = _cli(tmp_path, "part", "--train.steps", "6", "--zero.stage", "3",
                   "--zero.offload_optimizer", "cpu", "--logging.sample_tokens", "0",
                   "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _summary(tmp_path / "full"), _summary(tmp_path / "part")
    assert abs(a["final_train_loss"] - b["final_train_loss"]) <= 1e-3
    s = subprocess.run([sys.executable, "-m", "zerotrain", "sample", "--checkpoint",
                        str(tmp_path / "full" / "checkpoints"), "--tokens", "8"],
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0 and s.stdout.startswith("def "), s.stderr[-2000:]


@pytest.mark.skipif(GPUS < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("extra", [("--zero.stage", "3", "--precision.dtype", "bf16"),
                                   ("--zero.stage", "2", "--comm.algorithm", "ring")],
                         ids=["zero3-bf16", "zero2-ring"])
def test_nccl_trains_at_every_gpu(tmp_path, extra):
    n = min(GPUS, 4)
    r = _cli(tmp_path, "nccl", "--nproc", str(n), "--train.steps", "6",
             "--logging.sample_tokens", "16", "--comm.check_lockstep", "true", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(tmp_path / "nccl")
    assert s["world_size"] == n and s["step"] == 6


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_more_ranks_than_gpus_is_one_error(tmp_path):
    r = _cli(tmp_path, "over", "--nproc", str(GPUS + 1), "--train.steps", "2", timeout=120)
    assert r.returncode != 0
    assert f"{GPUS + 1} local ranks but {GPUS} visible GPU" in r.stderr
