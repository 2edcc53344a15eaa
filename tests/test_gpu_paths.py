"""The CUDA/NCCL paths of the GPU review (issue 18), simulated on the CPU.

No GPU here, so each hazard is reproduced by the contract it breaks: a process group
registered for `cuda` only (NCCL's shape), a stand-in device (`simdevice.py`) whose
tensors refuse to meet CPU tensors, patched device counts, a backend reported as NCCL.
The real thing runs in `tests/test_gpu.py` (`-m gpu`, from `bench/gpu_check.sh`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from simdevice import SIM, SimDevice, nccl_like_all_reduce
from zerotrain.comm import dist as zdist
from zerotrain.comm.collectives import Comm
from zerotrain.config import ConfigError, build_config

from multirank import run_ranks


@pytest.fixture
def cuda_only_group():
    """A one-process group whose only backend is registered for `cuda`, as NCCL's is."""
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- C1


def test_a_cuda_only_group_refuses_cpu_tensors_and_comm_uses_its_device(cuda_only_group):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(2, dtype=torch.float64))
    assert zdist.comm_device().type == "cuda"
    comm = Comm("ring")
    assert comm.device.type == "cuda" and comm._thread is None
    comm.close()


def test_comm_device_is_the_cpu_for_gloo():
    assert zdist.comm_device() == torch.device("cpu")  # no group at all
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert zdist.comm_device() == torch.device("cpu")
        assert Comm().all_reduce_scalars([0.1, 2.0]).tolist() == [0.1, 2.0]  # fp64 kept
    finally:
        dist.destroy_process_group()


def _text(tmp: Path, lines: int = 400) -> Path:
    p = tmp / "corpus.txt"
    if not p.exists():  # written by the test, before any rank starts
        p.write_text("".join(f"line {i:04d}: the quick brown fox jumps over the lazy dog\n"
                             for i in range(lines)))
    return p


def _train_cfg(tmp: Path, run: str, stage: int, **extra):
    d = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
         "data": {"path": str(_text(tmp)), "micro_batch_size": 4},
         "schedule": {"warmup_steps": 0}, "zero": {"stage": stage},
         "train": {"steps": 4, "threads": 1, "device": "cpu",
                   "spike_guard": {"enabled": True, "window": 5}},
         "logging": {"run_dir": str(tmp / run), "log_every": 1, "eval_every": 2,
                     "sample_tokens": 8, "progress": False, "plot": False}}
    for k, v in extra.items():
        d.setdefault(k, {}).update(v)
    return build_config(d)


def _train_on_a_gpu_like_group(tmp: str, stage: int) -> dict:
    """Train twice: plainly, then with the Comm on a non-CPU device whose group, like
    NCCL's, refuses CPU tensors. Every control reduction must reach it on that device."""
    import zerotrain.comm.collectives as coll
    from zerotrain.run.loop import train

    tmp_path = Path(tmp)
    plain = train(_train_cfg(tmp_path, "plain", stage))
    calls: list[tuple[str, str]] = []
    real_all_reduce, real_device = dist.all_reduce, getattr(coll, "comm_device", None)
    dist.all_reduce = nccl_like_all_reduce(real_all_reduce, calls)
    coll.comm_device = lambda group=None: SIM
    try:
        with SimDevice():
            sim = train(_train_cfg(tmp_path, "sim", stage))
    finally:
        dist.all_reduce, coll.comm_device = real_all_reduce, real_device
    return {"plain": plain, "sim": sim, "calls": calls}


@pytest.mark.slow
def test_control_reductions_run_on_the_comm_device(tmp_path):
    """ZeRO-2: its data moves by reduce-scatter and all-gather, so every all-reduce in
    the run is a control reduction (stage 0's gradient all-reduce of CPU tensors would
    be refused by the stand-in group, rightly: on a GPU those tensors are on the GPU)."""
    _text(tmp_path)
    stage = 2
    for res in run_ranks(_train_on_a_gpu_like_group, 2, str(tmp_path), stage):
        devices = {d for d, _ in res["calls"]}
        callers = {c for _, c in res["calls"]}
        assert devices == {"meta"}, res["calls"]
        # loss logging, eval totals, bytes per token, preemption flag, spike guard, the
        # finite-weights check, and (sharded optimizers) the gradient norm
        want = {"_log_step", "evaluate", "val_bytes_per_token", "_cast", "_spike",
                "weights_finite"} | ({"grad_norm_sq"} if stage else set())
        assert want <= callers, callers
        for key in ("final_val_loss", "final_train_loss", "first_val_loss"):
            assert res["sim"][key] == res["plain"][key], key


# ----------------------------------------------------------------------------- C3, L1, L5


def _gpus(monkeypatch, n: int) -> list[torch.device]:
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    return current


def test_more_local_ranks_than_gpus_is_one_error(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"2 local ranks but 1 visible GPU.*--nproc <= 1"):
        zdist.pick_device("auto", 0, local_world=2)
    _gpus(monkeypatch, 2)
    assert zdist.pick_device("auto", 1, local_world=2) == torch.device("cuda", 1)
    assert zdist.pick_device("cpu", 1, local_world=8) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        zdist.pick_device("cuda", 0)


def test_the_launcher_checks_gpus_before_starting_ranks(monkeypatch, tmp_path):
    from zerotrain.run.setup import check_before_launch

    _gpus(monkeypatch, 1)
    cfg = _train_cfg(tmp_path, "run", 0, train={"device": "auto"})
    with pytest.raises(ConfigError, match="2 local ranks but 1 visible GPU"):
        check_before_launch(cfg, None, 2)


def test_rank_without_local_rank_binds_the_gpu_init_distributed_would(monkeypatch):
    """L1: a launcher that sets RANK but not LOCAL_RANK: the engine's device and the
    process group's agree (RANK), and that device is made current."""
    current = _gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert zdist.bind_device("auto") == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]


def test_gloo_on_cuda_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"comm.backend 'gloo' with CUDA.*no stand-in for NCCL"):
        zdist.pick_backend("gloo", torch.device("cuda", 0))
    assert zdist.pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert zdist.pick_backend("gloo", torch.device("cpu")) == "gloo"


# ----------------------------------------------------------------------------- H2


def _ring_thread_by_backend() -> dict:
    """The ring with the group reported as NCCL runs on the calling thread."""
    from zerotrain.comm import ring

    seen: list[str] = []
    real_exchange = ring._exchange

    def exchange(*a):
        seen.append(threading.current_thread().name)
        return real_exchange(*a)

    ring._exchange = exchange
    out = {}
    r, n = dist.get_rank(), dist.get_world_size()
    for backend in ("gloo", "nccl"):
        real = dist.get_backend
        dist.get_backend = lambda group=None, b=backend: b
        try:
            comm = Comm("ring")
        finally:
            dist.get_backend = real
        x = torch.arange(10.0) + r
        h = comm.all_reduce(x, async_op=True)
        h.wait()
        out[backend] = {"thread": comm._thread is not None, "ran_on": sorted(set(seen)),
                        "ok": torch.equal(x, n * torch.arange(10.0) + sum(range(n)))}
        seen.clear()
        comm.close()
    return out


def test_no_comm_thread_on_nccl():
    for res in run_ranks(_ring_thread_by_backend, 2):
        assert res["gloo"] == {"thread": True, "ran_on": ["zerotrain-comm"], "ok": True}
        assert res["nccl"] == {"thread": False, "ran_on": ["MainThread"], "ok": True}


# ------------------------------------------- S7: gradients on a process group of their own


def _groups_used(eng) -> list[tuple[str, str]]:
    """Probe: record, for every native collective, which group it went to."""
    comm, seen = eng.comm, []

    def spy_on(c, label: str) -> None:
        real = c._collective

        def spy(op, *args, **kw):
            seen.append((op, label))
            return real(op, *args, **kw)

        c._collective = spy

    spy_on(comm, "main")
    if comm.grads is not comm:
        spy_on(comm.grads, "grads")
    if comm._ring_group is not None:  # the ring's gradient passes get a ring group too
        seen.append(("ring groups", "separate" if comm.grads._ring_group is not
                     comm._ring_group else "same"))
    return seen


def _with_and_without_grad_group(cases: list[dict]) -> list[tuple[dict, dict]]:
    from zero_harness import run_many

    on = [{**c, "comm": {**c.get("comm", {}), "grad_group": True}} for c in cases]
    return list(zip(run_many(cases, 3), run_many(on, 3, probe=_groups_used)))


def test_gradient_reductions_get_their_own_group_and_change_nothing():
    """S7: with comm.grad_group (auto: on NCCL, where a group is one CUDA stream) the
    gradient reduce-scatters/all-reduces go to a second group, parameter all-gathers and
    control reductions stay on the first, and training is bit-identical."""
    assert build_config({}).comm.grad_group == "auto"
    cases = [{"zero": {"stage": 3}, "comm": {"algorithm": "native"}},
             {"zero": {"stage": 0}, "comm": {"algorithm": "native"}},
             {"zero": {"stage": 2}, "comm": {"algorithm": "ring"}}]
    for rank_result in run_ranks(_with_and_without_grad_group, 2, cases):
        for case, (plain, split) in zip(cases, rank_result):
            assert plain["losses"] == split["losses"], case
            assert all(torch.equal(plain["params"][k], split["params"][k])
                       for k in plain["params"]), case
            used = split["probe"]
            grads = {g for name, g in used if name in ("reduce_scatter", "all_reduce")}
            others = {g for name, g in used if name in ("all_gather", "all_reduce_scalars")}
            if case["comm"]["algorithm"] == "native":
                assert grads == {"grads"}, (case, used)
            else:
                assert ("ring groups", "separate") in used, (case, used)
            assert others <= {"main"}, (case, used)
