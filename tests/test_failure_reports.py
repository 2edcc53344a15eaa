"""What a user sees when a run fails or is stopped: the failing rank's own error as the
one line (never a healthy rank torn down by it, whatever order the processes ended in),
no tracebacks from victims, a second Ctrl-C that aborts, a recovery hint that works,
disk full as one line, and no progress-bar redraws in a log file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerotrain.checkpoint import CheckpointError
from zerotrain.comm.launch import PEER_GONE, choose_cause, outcomes, peer_gone
from zerotrain.run.loop import train
from zerotrain.run.report import phase_text

from zero_harness import run_config

GLOO_GONE = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
             "peer [127.0.0.1]:22955. This is typically caused by a remote worker crashing.")


# ----------------------------------------------------------------- choosing the cause
def _failure(code: int, message: str = "", timestamp: int = 100) -> SimpleNamespace:
    """What torchrun records of a failed rank (its ProcessFailure's fields we read)."""
    return SimpleNamespace(exitcode=code, timestamp=timestamp,
                           message={"message": message} if message else "")


def _note(errors: Path, rank: int, kind: str, message: str, when: float) -> None:
    (errors / f"rank{rank}.json").write_text(json.dumps(
        {"kind": kind, "prog": "zerotrain train", "message": message, "time": when}))


@pytest.mark.parametrize("healthy_first", [True, False])
def test_the_rank_with_its_own_error_is_the_cause_whatever_the_timing(tmp_path,
                                                                       healthy_first):
    """The audit's case: rank 1's shard is damaged, rank 0 dies in a gloo collective and
    then by the agent's SIGTERM, and torchrun's whole-second timestamps tie or favour
    rank 0. The line must be rank 1's own error, named as rank 1's."""
    t0 = 1000.0
    damaged = "'ck/step_2/rank00001.safetensors' is damaged (its checksum does not match)"
    _note(tmp_path, 1, "error", damaged, t0 + (0.5 if healthy_first else 0.1))
    # rank 0: torchrun's record of a gloo traceback, killed by the agent's SIGTERM,
    # earlier (or equal) in torchrun's timestamps
    failures = {0: _failure(-15, f"RuntimeError: {GLOO_GONE}", 999 if healthy_first else 1000),
                1: _failure(2, "", 1000)}
    cause, line = choose_cause(outcomes(failures, tmp_path), 2)
    assert cause.rank == 1
    assert line == f"zerotrain train: error: rank 1 of 2: {damaged}"
    # with rank 0's own note (our handler caught the gloo error) the answer is the same
    _note(tmp_path, 0, "peer", GLOO_GONE, t0 + (0.0 if healthy_first else 0.9))
    cause, line = choose_cause(outcomes(failures, tmp_path), 2)
    assert cause.rank == 1 and "damaged" in line


def test_a_killed_rank_is_the_cause_not_the_rank_the_agent_stopped(tmp_path):
    failures = {0: _failure(-15, "", 99), 1: _failure(-9, "", 100)}
    _, line = choose_cause(outcomes(failures, tmp_path), 2)
    assert line == "zerotrain: rank 1 of 2 failed (killed by signal 9 (SIGKILL))"
    # a bug's traceback on rank 1 beats rank 0's broken connection, in any order
    failures = {0: _failure(1, f"RuntimeError: {GLOO_GONE}", 99),
                1: _failure(1, "RuntimeError: rank one exploded", 100)}
    _, line = choose_cause(outcomes(failures, tmp_path), 2)
    assert line == "zerotrain: rank 1 of 2 failed (exit code 1): RuntimeError: rank one exploded"


def test_an_error_every_rank_reports_names_no_rank(tmp_path):
    for r in range(3):
        _note(tmp_path, r, "error", "data.path 'x' does not exist", 10.0 - r)
    cause, line = choose_cause(outcomes({r: _failure(2) for r in range(3)}, tmp_path), 3)
    assert cause.rank == 2  # the earliest note
    assert line == "zerotrain train: error: data.path 'x' does not exist"


def test_peer_gone_knows_broken_connections_only():
    assert peer_gone(RuntimeError(GLOO_GONE))
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert peer_gone(nccl)
    try:  # found through the chain, as when a caller re-raises
        try:
            raise RuntimeError(GLOO_GONE)
        except RuntimeError as e:
            raise ValueError("while publishing unit 3") from e
    except ValueError as e:
        assert peer_gone(e)
    assert not peer_gone(RuntimeError("probability tensor contains inf"))
    assert not peer_gone(ValueError(PEER_GONE[0]))  # not an error type collectives raise


# ----------------------------------------------------------------- the real thing, 2 ranks
def _cli(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(Path(__file__).read_text() * 20)
    args = [sys.executable, "-m", "zerotrain", "train", "--nproc", "2", "--model.n_layer", "1",
            "--model.n_embd", "32", "--model.n_head", "2", "--model.block_size", "32",
            "--schedule.warmup_steps", "0", "--logging.eval_every", "0",
            "--logging.sample_tokens", "0", "--logging.plot", "false", "--train.threads", "1",
            "--checkpoint.every", "1", "--data.path", str(corpus),
            "--logging.run_dir", str(tmp / "run"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
def test_a_damaged_shard_on_rank_1_is_the_line_the_user_sees(tmp_path):
    # ZeRO-2: only rank 1 reads rank 1's shard (a stage-0 checkpoint is read whole by every
    # rank, so there every rank reports the damage, and the line names no rank)
    r = _cli(tmp_path, "--train.steps", "2", "--zero.stage", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    shard = ckpt / "step_00000002" / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated (the audit's reproducer)
    r = _cli(tmp_path, "--train.steps", "4", "--resume", "--zero.stage", "2")
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("zerotrain train: error: rank 1 of 2: "), r.stderr[-3000:]
    assert "rank00001.safetensors' is damaged" in last, last
    assert "step_00000001 still loads" in last, last
    # no traceback from the healthy rank, no torchrun log line (E1201 ... exitcode: 2)
    for noise in ("Traceback", "[rank0]", "Connection closed", "exitcode"):
        assert noise not in r.stderr, r.stderr[-3000:]


# ----------------------------------------------------------------- signals
STUCK = """
import os
from zerotrain.run.lifecycle import Preemption
r, w = os.pipe()
with Preemption(announce=True) as p:
    print("ready", flush=True)
    os.read(r, 1)   # a step that never ends: each signal's handler runs, then it waits on
"""


def _ctrl_c_twice(p: subprocess.Popen, settle: float, between: float, wait: float) -> str:
    """Ctrl-C a process once it says "ready", check the first one did not end it, Ctrl-C
    again; its stderr."""
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(settle)
        p.send_signal(signal.SIGINT)
        time.sleep(between)
        assert p.poll() is None  # the first Ctrl-C only asks to stop after the step
        p.send_signal(signal.SIGINT)
        p.wait(wait)
    finally:
        if p.poll() is None:
            p.kill()
    return p.stderr.read()


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_a_step_that_never_ends(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    err = _ctrl_c_twice(p, settle=0.0, between=0.5, wait=10)
    assert p.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines[0].endswith("press Ctrl-C again to abort without saving"), err
    assert lines[1].startswith("zerotrain: aborted by a second Ctrl-C without saving"), err


@pytest.mark.slow
def test_an_error_starts_on_its_own_line_below_the_bar(tmp_path):
    """On a terminal the bar's line has no newline until the bar closes; an error raised
    mid-run used to be glued to it (`...skip=2]zerotrain train: error: ...`)."""
    import fcntl
    import pty
    import struct
    import termios

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 20)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    args = [sys.executable, "-m", "zerotrain", "train", "--model.n_layer", "1",
            "--model.n_embd", "32", "--model.n_head", "2", "--model.block_size", "32",
            "--data.path", str(corpus), "--logging.run_dir", str(tmp_path / "run"),
            "--optimizer.name", "sgd", "--optimizer.lr", "1e6", "--optimizer.grad_clip", "0",
            "--optimizer.weight_decay", "0", "--train.max_skipped_steps", "2",
            "--schedule.warmup_steps", "0", "--train.steps", "40", "--logging.log_every", "1",
            "--logging.eval_every", "0", "--checkpoint.every", "0", "--train.threads", "1"]
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(60) == 2, out[-2000:]
    text = out.decode(errors="replace")
    assert "%|" in text  # a bar was drawn
    i = text.index("zerotrain train: error: 2 optimizer steps in a row")
    assert text[:i].endswith("\n"), repr(text[i - 200:i + 40])


@pytest.mark.slow
def test_a_second_ctrl_c_to_the_launcher_aborts_ranks_that_do_not_stop():
    code = ("from zerotrain.comm.launch import launch_local; import sys; "
            "sys.exit(launch_local(2, [], module='stuck_rank'))")
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    # settle: both ranks up (they ignore SIGINT from the start); between: the ranks were
    # asked to save and stop, and take time
    err = _ctrl_c_twice(p, settle=0.5, between=1.0, wait=30)
    assert p.returncode == 130, err
    assert "press Ctrl-C again to abort without saving" in err
    assert err.strip().splitlines()[-1].startswith(
        "zerotrain: aborted by a second Ctrl-C: the ranks were stopped without saving"), err
    assert "Traceback" not in err


# ----------------------------------------------------------------- one process
def _cfg(tmp_path, steps: int, **extra):
    return run_config(tmp_path, "run", steps, layers=1, **extra)


def test_the_recovery_hint_only_names_a_checkpoint_that_loads(tmp_path, capsys):
    """A checkpoint of another model: the older one of the same run fails the same way,
    so no "still loads" hint (the audit's ping-pong); the differing setting instead."""
    train(_cfg(tmp_path, 4, logging={"progress": True}), resume="auto")
    out = capsys.readouterr()
    assert "--resume auto: no complete checkpoint" in out.out + out.err
    assert "starting a new run" in out.out + out.err
    assert (out.out + out.err).count("peak memory per phase") == 1  # not again at the end
    # stderr is no terminal here: plain progress lines, no bar redraws
    assert "\r" not in out.err and "step 4/4: loss " in out.err
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tmp_path, 6, model={"n_embd": 64}), resume="latest")
    msg = str(e.value)
    assert "still loads" not in msg
    assert "model.n_embd 32 (this run: 64)" in msg
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tmp_path, 6, optimizer={"name": "lion"}), resume="latest")
    assert "still loads" not in str(e.value) and "reset_optimizer" in str(e.value)


def test_disk_full_at_save_is_one_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import errno
    import os

    from zerotrain.checkpoint import stream

    real, calls = stream.write, []

    def full_after_first(path, tensors, *a, **k):
        calls.append(path)
        if len(calls) > 1:  # what the file's write raises on a full disk
            Path(path).write_bytes(b"\0" * 10)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, tensors, *a, **k)

    monkeypatch.setattr(stream, "write", full_after_first)
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tmp_path, 4))
    msg = str(e.value)
    root = tmp_path / "run" / "checkpoints"
    assert msg.startswith(f"no space left on device while saving the step-4 checkpoint in "
                          f"'{root}' (this rank writes about ")
    assert "bytes free" in msg and "step_00000002, is intact" in msg
    assert (root / "latest").read_text().strip() == "step_00000002"
    # and it resumes from there
    monkeypatch.setattr(stream, "write", real)
    assert train(_cfg(tmp_path, 4), resume="latest")["steps_run"] == 2


def test_the_phase_line_compares_only_what_compares():
    mib = 2**20
    tiny = {"measured": {"init": 0.1 * mib, "forward": 27.9 * mib},
            "predicted": {"init": 0.1 * mib, "forward": 1.8 * mib}}
    line = phase_text(tiny, True, cpu=True)
    assert "(measured): init 0.1, forward 27.9; not compared" in line
    assert "1.8 / " not in line and "at most 1.8 MiB" in line
    big = {"measured": {"forward": 167.5 * mib}, "predicted": {"forward": 126.1 * mib}}
    line = phase_text(big, False, cpu=True)
    assert line.endswith("not activations or the runtime's own memory (tens of MiB on a "
                         "CPU)): forward 167.5 / 126.1")
    assert "forward 27.9 / 1.8" in phase_text(tiny, True, cpu=False)  # GPU: allocator only
