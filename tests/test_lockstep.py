"""Ranks in lockstep (issue 18, item 2): uneven work under ZeRO-3 finishes or is named,
never a silent hang until the timeout; the process group's lifetime and patience."""

from __future__ import annotations

import datetime
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm import dist as zdist
from zerotrain.comm.collectives import Comm
from zerotrain.comm.lockstep import CollectiveTimeout, LockstepError

from multirank import free_port, run_ranks
from zero_harness import local_batch, make_config

# ----------------------------------------------------------------------------- the guard


def _extra_forward_on_rank_zero() -> dict:
    """Rank 0 runs one more ZeRO-3 forward than rank 1 (an all-gather per unit), then
    both reduce a loss: the guard must name the mismatch on both, at once."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    rank = dist.get_rank()
    cfg = make_config({"zero": {"stage": 3}, "comm": {"check_lockstep": True}}, 2, 4)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    X = torch.randint(0, 256, (24, 16))
    x, y = local_batch(X, X, rank, 2, cfg.data.micro_batch_size)
    t0 = time.perf_counter()
    error = None
    try:
        with torch.no_grad():
            loss = eng(x, y)
            if rank == 0:
                loss = eng(x, y)  # rank 0 raises here, rank 1 in the reduction
        eng.comm.all_reduce_scalars([float(loss)])
    except LockstepError as e:
        error = str(e)
    return {"error": error, "seconds": time.perf_counter() - t0}


@pytest.mark.slow
def test_a_mismatched_forward_is_named_not_hung():
    for res in run_ranks(_extra_forward_on_rank_zero, 2, timeout=120):
        e = res["error"]
        assert e is not None and "comm.check_lockstep" in e
        assert "rank(s) 1 differ from rank 0" in e
        assert "rank 0: all_gather(params)" in e and "rank 1: all_reduce_scalars(control)" in e
        assert res["seconds"] < 60


def test_the_message_names_every_rank_that_differs():
    from zerotrain.comm.lockstep import Lockstep, fingerprint

    ls = Lockstep(None, torch.device("cpu"), 0, 3)
    same = fingerprint(7, "all_gather", "params", 4096, torch.bfloat16)
    odd = fingerprint(7, "all_to_all", "muon", 10, torch.float32)
    msg = ls.message([same, same, odd])
    assert "rank(s) 2 differ from rank 0" in msg
    assert "rank 0: all_gather(params) of 4,096 bfloat16 elements [collective #7]" in msg
    assert "rank 2: all_to_all(muon) of 10 float32 elements [collective #7]" in msg


def _matching_ranks_pass() -> list[int]:
    comm = Comm("native", check_lockstep=True)
    comm.all_reduce(torch.ones(3))
    comm.all_gather(torch.empty(4), torch.ones(2))
    out = comm.all_reduce_scalars([1.0])
    return [comm.lockstep.seq, int(out[0])]


def test_the_guard_is_silent_when_ranks_agree():
    assert run_ranks(_matching_ranks_pass, 2) == [[3, 2], [3, 2]]


def _one_rank_never_joins() -> str | None:
    """A collective on a 2 s group that rank 1 never enters: rank 0's error names the
    setting to change and the debug mode, instead of gloo's socket message."""
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    comm = Comm("native", group=g, timeout_s=2)
    if dist.get_rank() == 1:
        time.sleep(4)
        return None
    try:
        comm.all_reduce(torch.ones(2))
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


def test_a_timeout_names_the_setting():
    msg, _ = run_ranks(_one_rank_never_joins, 2)
    assert msg.startswith("rank 0: all_reduce timed out after comm.timeout_s = 2 s"), msg
    assert "--comm.check_lockstep true" in msg and "raise comm.timeout_s" in msg


def test_timeout_default_is_minutes_not_ten():
    from zerotrain.config import build_config

    assert build_config({}).comm.timeout_s == 120
    assert build_config({}).comm.check_lockstep is False


# ----------------------------------------------------------------------------- issue 18 repro

TESTS = Path(__file__).parent


def _uneven_text(path: Path) -> Path:
    """49 validation windows of 33 bytes: ranks would get 25/24 (N=2) or 17/16/16 (N=3)."""
    path.write_text("".join(f"line {i:04d}: the quick brown fox jumps over the lazy dog\n"
                            for i in range(288)))
    return path


def _old_batch_counts(n_windows: int, world: int, mbs: int = 8) -> list[int]:
    """Validation batches per rank under the rule before the fix (ids[rank::world])."""
    return [math.ceil(len(range(r, n_windows, world)) / mbs) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_uneven_validation_under_zero3_finishes(tmp_path, nproc):
    from zerotrain.data.dataset import load_splits, resolve_tokenizer
    from zerotrain.data.sampler import WindowSampler

    text = _uneven_text(tmp_path / "small.txt")
    _, val = load_splits(text, resolve_tokenizer("bytes"), 0.1)
    n = WindowSampler(val, 32, 0, split="validation").n_windows
    assert len(set(_old_batch_counts(min(n, 64 * nproc), nproc))) > 1  # the hazard is real
    args = [sys.executable, "-m", "zerotrain", "train", "--model.n_layer", "1",
            "--model.n_embd", "32", "--model.n_head", "2", "--model.block_size", "32",
            "--data.micro_batch_size", "8", "--train.steps", "6", "--logging.eval_every", "3",
            "--schedule.warmup_steps", "0", "--data.path", str(text), "--zero.stage", "3",
            "--nproc", str(nproc), "--logging.run_dir", str(tmp_path / "run"),
            "--logging.progress", "false", "--logging.sample_tokens", "16",
            "--comm.timeout_s", "60", "--comm.check_lockstep", "true"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss" in r.stdout


# ----------------------------------------------------------------------------- lifetime


def test_train_closes_the_group_it_opened(tmp_path, monkeypatch):
    from zerotrain.config import build_config
    from zerotrain.run.loop import train

    text = _uneven_text(tmp_path / "t.txt")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = build_config({"model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
                        "data": {"path": str(text), "micro_batch_size": 2},
                        "schedule": {"warmup_steps": 0},
                        "train": {"steps": 2, "device": "cpu"},
                        "logging": {"run_dir": str(tmp_path / "run"), "progress": False,
                                    "plot": False, "sample_tokens": 0}})
    try:
        summary = train(cfg)
        assert summary["world_size"] == 1 and summary["step"] == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _patient(port: int) -> float:
    """Rank 0 works past the store's own 1 s timeout; rank 1 waits it out."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=dist.get_rank() == 0,
                          timeout=datetime.timedelta(seconds=1))
    zdist._STORE = dist.PrefixStore("test", store)
    try:
        if dist.get_rank() == 0:
            time.sleep(2.5)
        t0 = time.perf_counter()
        zdist.patient_barrier(timeout_s=60)
        zdist.patient_barrier(timeout_s=60)  # keys are per call: a second one works too
        waited = time.perf_counter() - t0
        dist.barrier()  # rank 0 hosts the store: keep it up until rank 1 has read it
        return waited
    finally:
        zdist._STORE = None


def test_the_data_preparation_wait_outlasts_the_collective_timeout():
    _, waited = run_ranks(_patient, 2, free_port())
    assert waited >= 2.0
