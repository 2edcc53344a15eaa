"""tests/multirank.py's warm rank pool: calls reuse the processes, yet each call sees a
fresh process group, the caller's environment and the spawned process's defaults; a
rank's error, death or hang fails its own call with the rank's traceback or stack, and
a call that leaves state behind retires its processes."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

import multirank
from multirank import run_ranks


def _who() -> dict:
    import torch.distributed as dist

    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return {
        "pid": os.getpid(),
        "sum": float(x),
        "port": os.environ["MASTER_PORT"],
        "var": os.environ.get("MULTIRANK_PROBE"),
        "rand": float(torch.rand(1)),
        "dtype": str(torch.get_default_dtype()),
    }


def _spoil() -> int:
    torch.manual_seed(123)
    torch.set_default_dtype(torch.float64)
    os.environ["MULTIRANK_PROBE"] = "left by a call"
    return 0


def test_calls_reuse_ranks_with_a_fresh_group_and_defaults(monkeypatch):
    monkeypatch.setenv("MULTIRANK_PROBE", "one")
    a = run_ranks(_who, 2)
    run_ranks(_spoil, 2)
    monkeypatch.setenv("MULTIRANK_PROBE", "two")
    b = run_ranks(_who, 2)
    assert [r["pid"] for r in a] == [r["pid"] for r in b]  # the same processes
    assert all(r["sum"] == 3.0 for r in a + b) and a[0]["port"] != b[0]["port"]
    assert [r["var"] for r in a + b] == ["one", "one", "two", "two"]
    # the RNG and default dtype as spawned, whatever the previous call did
    assert [r["rand"] for r in a] == [r["rand"] for r in b]
    assert {r["dtype"] for r in b} == {"torch.float32"}


def _fail_on_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")
    dist.barrier()  # rank 0 waits for a peer that is gone


def _hang() -> None:
    time.sleep(3600)


def _die() -> None:
    os._exit(7)


def test_errors_deaths_and_hangs_fail_their_call_and_retire_the_ranks():
    """The error at 2 ranks (the failing rank named first, before its peer's "connection
    closed"); a hang and a death at 1 rank (each failure costs a new spawn)."""
    pids = {r["pid"] for r in run_ranks(_who, 2)}
    with pytest.raises(AssertionError, match=r"(?s)^rank 1 failed:.*ValueError: rank one's"):
        run_ranks(_fail_on_one, 2, timeout=60)
    assert not pids & {r["pid"] for r in run_ranks(_who, 2)}  # new processes
    one = run_ranks(_who, 1)[0]["pid"]  # warm: the 3 s below are the call's own
    t0 = time.monotonic()
    with pytest.raises(
        AssertionError,
        match=r"(?s)rank\(s\) \[0\] did not finish within "
        r"3 s.*--- rank 0 ---.*in _hang",
    ):
        run_ranks(_hang, 1, timeout=3)
    with pytest.raises(AssertionError, match=r"rank 0 died \(exit code 7\) without a result"):
        run_ranks(_die, 1, timeout=60)
    assert time.monotonic() - t0 < 60
    assert run_ranks(_who, 1)[0]["pid"] != one


def _patch_and_forget() -> int:
    from zerotrain.checkpoint import io

    io._finish = lambda *a, **k: None  # never undone
    return os.getpid()


def test_a_call_that_leaves_a_patch_retires_its_ranks(capfd):
    pid = run_ranks(_patch_and_forget, 1)[0]
    assert re.search(
        r"retired after test_multirank\._patch_and_forget: rank 0: rebound "
        r"zerotrain\.checkpoint\.io\._finish",
        capfd.readouterr().err,
    )
    assert run_ranks(_who, 1)[0]["pid"] != pid


def test_fresh_and_world_sizes_beside_each_other():
    two, one = run_ranks(_who, 2), run_ranks(_who, 1)
    assert one[0]["sum"] == 1.0
    assert run_ranks(_who, 2)[0]["pid"] == two[0]["pid"]  # 2 + 1 ranks stay warm together
    once = run_ranks(_who, 1, fresh=True)
    assert once[0]["pid"] != one[0]["pid"] and 1 in multirank._POOLS
