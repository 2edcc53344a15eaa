"""`zerotrain train --nproc N` goes through torchrun: a real job, and a failing rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_failing_rank_fails_the_job_and_is_named():
    code = ("from zerotrain.comm.launch import launch_local; import sys; "
            "sys.exit(launch_local(2, [], module='failing_rank'))")
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0
    assert "zerotrain: rank 1 of 2 failed (exit code 1): RuntimeError: rank one exploded" \
        in r.stderr


def test_cli_trains_on_two_ranks_with_zero2(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TESTS / "test_zero.py").read_text() * 4)
    run = tmp_path / "run"
    args = [sys.executable, "-m", "zerotrain", "train", "--nproc", "2", "--zero.stage", "2",
            "--data.path", str(corpus), "--model.n_layer", "1", "--model.n_embd", "32",
            "--model.n_head", "2", "--model.block_size", "32", "--data.micro_batch_size", "4",
            "--train.steps", "6", "--schedule.warmup_steps", "2", "--logging.eval_every", "3",
            "--logging.run_dir", str(run), "--logging.sample_tokens", "20",
            "--logging.progress", "false"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = recs[-1]
    assert summary["type"] == "summary" and summary["world_size"] == 2
    assert summary["strategy"] == "zero2" and summary["step"] == 6
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text().startswith("def ")
    # the checkpoint is consolidated by `sample` and `export` without any process group
    r2 = subprocess.run([sys.executable, "-m", "zerotrain", "sample", "--checkpoint",
                         str(run / "checkpoints"), "--tokens", "10"],
                        capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0 and r2.stdout.startswith("def "), r2.stderr[-2000:]
    r3 = subprocess.run([sys.executable, "-m", "zerotrain", "export", str(run / "checkpoints"),
                         "--out", str(tmp_path / "m.safetensors"), "--dtype", "bf16"],
                        capture_output=True, text=True, timeout=120)
    assert r3.returncode == 0 and "bf16" in r3.stdout, r3.stderr[-2000:]
