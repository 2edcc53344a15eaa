"""Failures on 2 gloo ranks through the real `zerotrain train` command: a killed launcher,
preemption (SIGTERM, Ctrl-C), a killed rank, and self-healing restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
         "--model.block_size", "32", "--schedule.warmup_steps", "0", "--logging.eval_every",
         "0", "--logging.sample_tokens", "0", "--logging.progress", "false",
         "--logging.log_every", "1", "--train.threads", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _args(tmp: Path, run: str, *extra: str) -> list[str]:
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(Path(__file__).read_text() * 20)
    return [sys.executable, "-m", "zerotrain", "train", *SMALL, "--data.path", str(corpus),
            "--logging.run_dir", str(tmp / run), *extra]


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, limit: float = 120):
    """Block until the run has logged `step` (never sleep-and-hope)."""
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        f = run_dir / "metrics.jsonl"
        if f.exists() and any(s >= step for s in _losses_safe(f)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {limit}s")


def _losses_safe(f: Path) -> list[int]:
    steps = []
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("type") == "train":
            steps.append(r["step"])
    return steps


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_ranks_die_with_their_launcher(tmp_path):
    p = subprocess.Popen(_args(tmp_path, "k", "--nproc", "2", "--train.steps", "100000"),
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_step(tmp_path / "k", 2, p)
    ranks = _children(p.pid)
    assert len(ranks) == 2
    p.kill()  # kill -9 of the launcher only
    p.wait()
    deadline = time.time() + 20
    while any(_alive(r) for r in ranks) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(r) for r in ranks), "ranks outlived their launcher"


@pytest.mark.parametrize("nproc, sig", [(2, signal.SIGTERM), (1, signal.SIGINT)])
def test_preemption_saves_and_exits_cleanly(tmp_path, nproc, sig):
    run = tmp_path / "p"
    p = subprocess.Popen(_args(tmp_path, "p", "--nproc", str(nproc), "--train.steps", "100000"),
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run, 3, p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, (out, err)
    assert "Traceback" not in out + err
    lines = [x for x in err.splitlines() if "interrupted at step" in x]
    assert len(lines) == 1, err
    step = int(lines[0].split("interrupted at step ")[1].split(";")[0])
    assert "checkpoint saved" in lines[0] and "resume with --resume" in lines[0]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{step:08d}"
    # and the run continues from exactly there
    r = subprocess.run(_args(tmp_path, "p", "--nproc", str(nproc), "--train.steps",
                             str(step + 2), "--resume"), env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"at step {step}" in r.stdout + r.stderr


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    r = subprocess.run(_args(tmp_path, "f", "--nproc", "2", "--train.steps", "12",
                             "--train.fault.rank", "1", "--train.fault.step", "3"),
                       env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last == "zerotrain: rank 1 of 2 failed (killed by signal 9 (SIGKILL))", r.stderr[-2000:]
    # the survivor, torn down by its peer, prints no traceback; torchrun's log is quiet
    assert "Traceback" not in r.stderr and "exitcode" not in r.stderr, r.stderr[-3000:]


def test_restart_after_a_fault_ends_bit_identical(tmp_path):
    common = ["--nproc", "2", "--train.steps", "12", "--checkpoint.every", "4"]
    clean = subprocess.run(_args(tmp_path, "clean", *common), env=ENV, capture_output=True,
                           text=True, timeout=180)
    assert clean.returncode == 0, clean.stderr
    healed = subprocess.run(_args(tmp_path, "healed", *common, "--max-restarts", "1",
                                  "--train.fault.rank", "1", "--train.fault.step", "7"),
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert healed.returncode == 0, healed.stderr[-3000:]
    assert "resumed from" in healed.stdout + healed.stderr  # it really restarted
    assert ("zerotrain: rank 1 of 2 failed (killed by signal 9 (SIGKILL)); restarting (1 of 1) "
            "from the last complete checkpoint") in healed.stderr, healed.stderr[-3000:]
    assert "Traceback" not in healed.stderr and "exitcode" not in healed.stderr
    a, b = _losses(tmp_path / "clean"), _losses(tmp_path / "healed")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert all(a[s] == b[s] for s in a), (a, b)  # FP32 on CPU: bit for bit
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "clean/checkpoints/step_00000012/rank00000.safetensors"))
    wb = load_file(str(tmp_path / "healed/checkpoints/step_00000012/rank00000.safetensors"))
    assert all((wa[k] == wb[k]).all() for k in wa if k.startswith("strategy."))
