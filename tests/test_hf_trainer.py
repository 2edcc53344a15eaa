"""An unchanged Hugging Face Trainer script (bench/hf_script.py) under `zerotrain launch`
at ZeRO-3, 2 ranks: from_pretrained under zero.Init, train, a Trainer checkpoint, and
save_model; then the checkpoint resumed on 1 rank. Checked against the files themselves:
save_model's folder loads with from_pretrained and holds the whole weights (the ones
the Trainer saved), and the 1-rank resume of step 3 from the 2-rank checkpoint of step 2
gives the 2-rank run's step-3 loss and weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "hf_script.py"


def launch(nproc: int, args: list[str], cwd: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", "zerotrain", "launch", "--nproc", str(nproc), str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


@pytest.mark.slow
def test_trainer_zero3_save_model_and_resume_at_another_world_size(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    import hf_script

    model = tmp_path / "llama"
    hf_script.make_model_dir(model, 256, 32, 2)
    ds = tmp_path / "z3.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {
                    "stage": 3,
                    "stage3_gather_16bit_weights_on_model_save": True,
                },
            }
        )
    )
    out = launch(
        2,
        [
            str(tmp_path / "a"),
            "--ds",
            str(ds),
            "--steps",
            "3",
            "--save-steps",
            "2",
            "--model",
            str(model),
        ],
        tmp_path,
    )
    assert out.count("resolves to zerotrain.deepspeed") == 1  # said once, on rank 0
    log = json.loads((tmp_path / "a" / "result_rank0.json").read_text())["log"]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["loss"] > 0 for r in log)
    final = tmp_path / "a" / "final"
    saved = load_file(final / "model.safetensors")
    start = load_file(model / "model.safetensors")
    assert set(saved) == set(start)  # every weight, whole
    assert all(saved[k].shape == start[k].shape for k in saved)
    assert all(not torch.equal(saved[k], start[k]) for k in saved)  # all trained
    back = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    # step 3 again on 1 rank with twice the accumulation (the same global batch), from the
    # 2-rank checkpoint of step 2: the same loss and the same weights after it
    launch(
        1,
        [
            str(tmp_path / "b"),
            "--ds",
            str(ds),
            "--steps",
            "3",
            "--save-steps",
            "2",
            "--gas",
            "4",
            "--model",
            str(model),
            "--resume",
            str(tmp_path / "a" / "run" / "checkpoint-2"),
        ],
        tmp_path,
    )
    again = json.loads((tmp_path / "b" / "result_rank0.json").read_text())["log"]
    assert [r["step"] for r in again] == [3]
    assert again[0]["loss"] == pytest.approx(log[2]["loss"], rel=1e-5)
    resumed = load_file(tmp_path / "b" / "final" / "model.safetensors")
    for k in saved:
        torch.testing.assert_close(resumed[k], saved[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_trainer_evaluate_before_train_at_zero3(tmp_path):
    """`trainer.evaluate()` with no `train()` (transformers' ZeRO inference: initialize
    without an optimizer), 2 ranks: the eval loss equals a plain Trainer's (no DeepSpeed,
    1 process) and `save_model` writes the loaded weights. Before: refused ("no
    optimizer")."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "bench"))
    import hf_script

    model = tmp_path / "llama"
    hf_script.make_model_dir(model, 256, 32, 2)
    ds = tmp_path / "z3.json"
    z = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "zero_optimization": z,
            }
        )
    )
    launch(
        2, [str(tmp_path / "zt"), "--ds", str(ds), "--model", str(model), "--eval-only"], tmp_path
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(tmp_path / "plain"),
            "--ds",
            "none",
            "--model",
            str(model),
            "--eval-only",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads((tmp_path / "zt" / "result_rank0.json").read_text())["eval_loss"]
    want = json.loads((tmp_path / "plain" / "result_rank0.json").read_text())["eval_loss"]
    assert got == pytest.approx(want, rel=1e-6, abs=0)
    saved = load_file(tmp_path / "zt" / "final" / "model.safetensors")
    source = load_file(model / "model.safetensors")
    assert saved.keys() == source.keys()
    assert all(torch.equal(saved[k], source[k]) for k in source)
