"""The third GPU review (`shared/findings/gpu-review-2.md`, issue 21 §2), on the CPU.

Each defect is reproduced by the contract it breaks on CUDA: the stand-in accelerator
(`simdevice.py`, whose tensors refuse every mixing op CUDA refuses), patched CUDA device
queries, recorded collective order, and gloo groups for the lifecycle items.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simdevice import SIM, SimDevice, SimTensor
from zerotrain.zero.muon import MatrixOwners
from zerotrain.zero.update import UnitByUnit

# ----------------------------------------------------------------------------- stand-in


def _refused(fn) -> bool:
    try:
        fn()
    except RuntimeError as e:
        assert "Expected all tensors to be on the same device" in str(e), e
        return True
    return False


def test_the_stand_in_refuses_what_cuda_refuses_and_allows_what_it_allows():
    """CUDA's rule: devices never mix, except copies between them, a 0-d CPU tensor read
    as a scalar by an elementwise op, and CPU index tensors in advanced indexing."""
    with SimDevice():
        s = torch.arange(4.0).to("meta")
        cpu, scalar = torch.ones(4), torch.tensor(2.0)
        assert isinstance(s, SimTensor) and s.device == SIM
        refused = {
            "stack with a 0-d CPU tensor": lambda: torch.stack([s[0], scalar]),
            "cat": lambda: torch.cat([s, cpu]),
            "cat with a 0-d CPU tensor": lambda: torch.cat([s[:1], scalar.reshape(1)]),
            "elementwise with a CPU vector": lambda: s + cpu,
            "a 0-d CPU tensor written by a device op": lambda: scalar.add_(s[0]),
            "index_select with a CPU index": lambda: torch.index_select(s, 0, torch.tensor([1])),
            "matmul": lambda: s @ cpu,
            "foreach with CPU vectors": lambda: torch._foreach_add_([s], [cpu]),
            "where with a CPU vector": lambda: torch.where(s > 1, s, cpu),
        }
        for what, fn in refused.items():
            assert _refused(fn), what
        allowed = {
            "0-d CPU scalar operand": lambda: s * scalar,
            "0-d CPU scalar on the left": lambda: scalar + s,
            "fill_ from a 0-d CPU tensor": lambda: s.clone().fill_(scalar),
            "foreach with a 0-d CPU scalar": lambda: torch._foreach_mul_([s.clone()], scalar),
            "copy device <- CPU": lambda: s.clone().copy_(cpu),
            "copy CPU <- device": lambda: cpu.clone().copy_(s),
            "advanced indexing with a CPU index": lambda: s[torch.tensor([0, 2])],
            "to the CPU": lambda: s.cpu(),
        }
        for what, fn in allowed.items():
            assert not _refused(fn), what
        assert torch.equal(s[torch.tensor([0, 2])].cpu(), torch.tensor([0.0, 2.0]))
        assert torch.equal((scalar + s).cpu(), torch.arange(4.0) + 2)
        out = cpu.clone()
        assert out.copy_(s) is out and torch.equal(out, torch.arange(4.0))


# ----------------------------------------------------------------------------- N1


class _HostComm:
    """all_reduce_scalars of one rank (the MAX over ranks is the identity here)."""

    device = torch.device("cpu")

    def all_reduce_scalars(self, t, op="sum"):
        return t.detach().to("cpu", torch.float64)


def test_fp8_refresh_at_two_ranks_on_a_device():
    """N1: at 2 ranks each rank holds pieces of only some FP8 weights; the amax vector
    stacked device amaxes with a CPU zero for the others, which CUDA refuses."""
    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params.fp8_wire import Fp8Wire, refresh_all
    from zerotrain.zero.partition import Partition

    g = torch.Generator().manual_seed(0)
    a, b = (nn.Parameter(torch.randn(64, 64, generator=g)) for _ in range(2))
    named = [("blk.q.weight", a, 0), ("blk.o.weight", b, 0)]
    packed = {}
    for dev in ("cpu", "meta"):
        u = FlatUnit.build(0, "blk", named, Partition(2, 0), align=8)
        u.wire = Fp8Wire(u, {"blk.q.weight", "blk.o.weight"}, 2)
        full = torch.cat([a.detach().flatten(), b.detach().flatten()]).bfloat16()
        lo, hi = u.shard_range
        with SimDevice():
            u.shard = full[lo:hi].clone().to(dev)
            # rank 0's shard covers q only: o's amax comes from the other rank
            assert {p.fp8 for p in u.wire.chunks[0] if p.fp8} == {"blk.q.weight"}
            refresh_all([u], _HostComm())
            assert u.wire.send.device.type == dev
            packed[dev] = u.wire.send.cpu()
    assert torch.equal(packed["cpu"], packed["meta"])


def _fp8_linear_pass(scaling: str, device: str) -> dict:
    from zerotrain.numerics.fp8 import FP8Recipe, FP8Stats
    from zerotrain.numerics.fp8_linear import Fp8Linear

    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    dev = torch.device(device)
    with SimDevice():
        m = Fp8Linear.from_linear(lin, FP8Recipe(scaling=scaling, matmul="emulate"),
                                  FP8Stats(dev))
        m.weight = nn.Parameter(lin.weight.detach().to(dev))
        m.bias = nn.Parameter(lin.bias.detach().to(dev))
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to(dev)
        xd = x.to(dev).requires_grad_()
        for _ in range(2):  # the delayed recipe's second pass reads its history
            y = m(xd)
            (y * y).sum().backward()
        assert y.device == dev and m.weight.grad.device == dev and xd.grad.device == dev
        return {"y": y.detach().cpu(), "gw": m.weight.grad.cpu(), "gx": xd.grad.cpu(),
                "counts": m.stats.counts.cpu()}


def test_fp8_linear_forward_and_backward_keep_to_the_device():
    """Every FP8 recipe's forward and backward on the stand-in: no CPU tensor meets a
    device tensor (scales, amaxes, counts, histories), and the values are the CPU's."""
    for scaling in ("tensorwise", "rowwise", "delayed"):
        sim, cpu = _fp8_linear_pass(scaling, "meta"), _fp8_linear_pass(scaling, "cpu")
        for k in cpu:
            assert torch.equal(sim[k], cpu[k]), (scaling, k)


# ----------------------------------------------------------------------------- N2

_LAUNCH_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "SLURM_LOCALID",
                "OMPI_COMM_WORLD_LOCAL_RANK", "CUDA_VISIBLE_DEVICES")


def _visible_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)


def _device_of_this_rank(monkeypatch, env: dict[str, str]) -> torch.device:
    from zerotrain.comm import dist as zdist

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return zdist.pick_device("auto", zdist.local_rank())


def test_each_rank_sees_only_its_own_gpu(monkeypatch):
    """N2, the review's three cases with one visible GPU per rank (SLURM per-task GPUs,
    Kubernetes): torchrun's variables with 8 local ranks, an srun wrapper without
    LOCAL_WORLD_SIZE, and a launcher that sets only the global RANK on node 2. Each rank
    takes its one GPU, cuda:0 (before: a ConfigError, cuda:3, cuda:11)."""
    cases = [{"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "RANK": "3"},
             {"LOCAL_RANK": "3", "RANK": "3"},
             {"RANK": "11"}]
    for env in cases:
        _visible_gpus(monkeypatch, 1)
        assert _device_of_this_rank(monkeypatch, env) == torch.device("cuda", 0), env


def test_the_node_local_rank_wins_over_the_global_rank(monkeypatch):
    """On node 2 of a multi-node job, RANK is global; SLURM and Open MPI say the local
    index, and that picks the GPU."""
    from zerotrain.comm import dist as zdist

    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        _visible_gpus(monkeypatch, 8)
        dev = _device_of_this_rank(monkeypatch, {"RANK": "13", var: "5"})
        assert dev == torch.device("cuda", 5), var
        assert zdist.local_rank_source() == var
    _visible_gpus(monkeypatch, 8)
    assert _device_of_this_rank(monkeypatch, {"RANK": "6"}) == torch.device("cuda", 6)


def test_a_rank_beyond_several_visible_gpus_is_one_error(monkeypatch):
    from zerotrain.comm import dist as zdist
    from zerotrain.config import ConfigError

    _visible_gpus(monkeypatch, 4)
    with pytest.raises(ConfigError, match=r"local rank 11 \(from RANK\).*4 GPUs "
                       r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\).*LOCAL_RANK.*CUDA_VISIBLE_DEVICES"):
        _device_of_this_rank(monkeypatch, {"RANK": "11", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    # the "N ranks > M GPUs" check belongs to the launcher, which knows the ranks share
    # its GPU list: a rank given LOCAL_WORLD_SIZE=8 with one visible GPU is isolated
    _visible_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match="8 local ranks but 1 visible GPU"):
        zdist.pick_device("auto", 0, local_world=8)


# ----------------------------------------------------------------------------- N3


def _first_unit_is_padding_here(eng) -> list[str]:
    """Probe: Offload-on-GPU's unit-by-unit step, with rank 1's share of unit 0 all
    padding (no optimizer segments there, as for a unit smaller than the world); record
    every collective and optimizer step in order."""
    s, comm, order = eng.strategy, eng.comm, []
    s.updater = UnitByUnit(s)
    if s.rank == 1:
        s.opt_segments = [sv for sv in s.opt_segments if sv[0].unit != 0]
        s.placement.attach(s.units, s.opt_segments)  # the home's views by unit, as built
    collective, step = comm._collective, eng.optimizer.step

    def spy(op, *args, **kw):
        order.append(op)
        return collective(op, *args, **kw)

    comm._collective = spy  # comm.grads is comm here (gloo, grad_group auto)
    eng.optimizer.step = lambda *a, **k: (order.append("step"), step(*a, **k))[1]
    return order


def _collective_order(cases: list[dict]) -> list[list[str]]:
    from zero_harness import run_many

    return [r["probe"] for r in run_many(cases, 3, probe=_first_unit_is_padding_here)]


def test_the_compile_vote_comes_before_any_publish_on_every_rank():
    """N3: the vote (a MAX all-reduce) runs at the top of the optimizer step on all
    ranks, so the collective order is the same on a rank that skips unit 0's update.
    (Before: rank 1 published unit 0 — an all-gather — before voting; the lockstep guard
    of the harness turns that into an error.)"""
    from multirank import run_ranks

    cases = [{"zero": {"stage": 2, "offload_optimizer": "cpu"}}]
    r0, r1 = run_ranks(_collective_order, 2, cases)
    for a, b in zip(r0, r1):
        collectives = [x for x in a if x != "step"]
        assert collectives == [x for x in b if x != "step"]
        # the vote: the first collective after the gradient reduce-scatters of step 1
        first = collectives.index("all_gather")
        assert "all_reduce_scalars" in collectives[:first]
        assert a.count("step") == b.count("step") + 3  # rank 1 skipped unit 0, 3 steps


# ----------------------------------------------------------------------------- N5


def _groups_after_close() -> dict:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from zerotrain.comm.collectives import Comm

    comm = Comm("ring", grad_group=True)
    made = [comm._ring_group, comm.grads.group, comm.grads._ring_group]
    before = [g in c10d._world.pg_map for g in made]
    x = torch.ones(8)
    comm.all_reduce(x)  # through the gradients' ring group
    comm.close()
    after = [g in c10d._world.pg_map for g in made]
    comm.close()  # idempotent
    y = torch.ones(1)
    dist.all_reduce(y)  # the default group is not the Comm's to destroy
    return {"distinct": len({id(g) for g in made}) == 3, "before": before, "after": after,
            "groups_left": len(c10d._world.pg_map), "sum": float(x[0]), "default": float(y)}


def test_close_destroys_every_group_the_comm_made():
    """N5: close() destroyed only the ring group; the gradients' own groups (each an
    NCCL communicator with device buffers) lived on, one or two more per Engine."""
    from multirank import run_ranks

    for res in run_ranks(_groups_after_close, 2):
        assert res == {"distinct": True, "before": [True] * 3, "after": [False] * 3,
                       "groups_left": 1, "sum": 2.0, "default": 2.0}


# ----------------------------------------------------------------------------- N7


class _PublishEvent:
    """Stands in for a unit's publish event: records whether the master was still the
    one the publish read when the host waited on it."""

    def __init__(self, u, log: list):
        self.u, self.log, self.master = u, log, u.master.clone()

    def synchronize(self) -> None:
        self.log.append((self.u.index, torch.equal(self.u.master, self.master)))


def test_muon_offload_fences_every_unit_before_writing_its_master():
    """N7: under Muon + Offload the CPU writes matrix slices in `MatrixOwners.apply`; a
    unit holding only matrices has no elementwise segment, so `attach_grads` never
    waited for its last publish copy. Every unit's fence must come before its write."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import batches, local_batch, make_config

    cfg = make_config({"zero": {"stage": 2, "offload_optimizer": "cpu", "bucket_mb": 0.005},
                       "optimizer": {"name": "muon"}, "comm": {"check_lockstep": False}},
                      1, 3)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    s = eng.strategy
    assert s.offload and isinstance(s.updater, MatrixOwners)
    matrix_only = [u.index for u in s.units
                   if u.index not in {seg.unit for seg, _ in s.updater.elementwise}]
    assert matrix_only, "the test needs a unit that holds matrices only"
    log: list = []
    for X, Y in batches(1):
        eng.backward(eng(*local_batch(X, Y, 0, 1, cfg.data.micro_batch_size)))
        for u in s.units:
            u.published = _PublishEvent(u, log)
        eng.step()
    eng.close()
    fenced = dict(log)
    assert set(fenced) == {u.index for u in s.units}, (sorted(fenced), matrix_only)
    assert all(fenced.values()), log  # each wait came before the unit's master changed


class _CudaEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_offload_publish_fences_its_staging_before_rewriting_it(monkeypatch):
    """N7: Offload on a GPU casts each unit's master into a pinned staging buffer that the
    asynchronous host-to-device copy reads; the next publish rewrote it unfenced when the
    unit had no optimizer segment (padding-only, or Muon's matrix-only units). The CUDA
    branch runs here with the runtime calls replaced: the fence precedes the write."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import make_config

    cfg = make_config({"zero": {"stage": 2, "offload_optimizer": "cpu"},
                       "precision": {"dtype": "bf16"}}, 1, 3)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    s = eng.strategy
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart())
    monkeypatch.setattr(torch.cuda, "Event", _CudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    s.placement.gpu = True  # the CUDA branch of HostOffload.write_master
    for u in s.units:
        s.publish(u)  # creates each unit's staging
    log: list = []

    class Published:
        def __init__(self, u):
            self.u, self.last = u, u.publish_staging.clone()

        def synchronize(self) -> None:  # the staging must still hold the last publish
            log.append((self.u.index, torch.equal(self.u.publish_staging, self.last)))

    with torch.no_grad():
        for u in s.units:
            u.published = Published(u)
            u.master.add_(1.0)  # a new update to publish
            s.publish(u)
            assert torch.equal(u.publish_staging, u.master.to(torch.bfloat16))
    s.placement.gpu = False
    eng.close()
    assert len(s.units) > 1 and log == [(u.index, True) for u in s.units], log


# ----------------------------------------------------------------------------- N9


class _FakeCudart:
    """cudaHostRegister/Unregister that record their calls (the real ones need a GPU)."""

    def __init__(self, fail: int = 0):
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        if self.fail:
            return self.fail
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_buffer_is_unregistered_when_its_memory_is_freed(monkeypatch):
    """N9: registration lives exactly as long as the memory — views keep it, dropping
    the last one unregisters (no close() needed); release_host_buffer unregisters once."""
    import gc

    from zerotrain.zero.states import host as offload

    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    t = offload.host_buffer(1000, torch.bfloat16, pinned=True)
    ptr = t.data_ptr()
    assert rt.registered == [(ptr, 2000)] and t.dtype == torch.bfloat16
    assert t.numel() == 1000 and not t.any()
    view = t[10:20]
    del t
    gc.collect()
    assert rt.unregistered == []  # a view still uses the memory
    view.fill_(1.0)
    del view
    gc.collect()
    assert rt.unregistered == [ptr]
    u = offload.host_buffer(10, torch.float32, pinned=True)
    offload.release_host_buffer(u)
    offload.release_host_buffer(u)
    del u
    gc.collect()
    assert rt.unregistered == [ptr, rt.registered[1][0]]  # once each


def test_close_waits_for_in_flight_copies_before_unregistering(monkeypatch):
    """N9: close() right after step() unregistered buffers that an asynchronous publish
    (compute stream) or gradient copy (side stream) could still be using."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT
    from zerotrain.zero.states import host as offload

    from zero_harness import make_config

    log: list[str] = []

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def synchronize(self) -> None:
            log.append(f"sync {self.name}")

    class Cudart(_FakeCudart):
        def cudaHostUnregister(self, ptr):
            log.append("unregister")
            return super().cudaHostUnregister(ptr)

    cfg = make_config({"zero": {"stage": 2, "offload_optimizer": "cpu"}}, 1, 3)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("compute"))
    p = eng.strategy.placement
    p.gpu, p.grads.stream = True, Stream("side")
    p.registered += [offload.host_buffer(8, torch.float32, True) for _ in range(2)]
    eng.close()
    assert log == ["sync compute", "sync side", "unregister", "unregister"]


def test_a_failed_registration_clears_the_cuda_error(monkeypatch):
    from zerotrain.zero.states import host as offload

    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(fail=712))
    from zerotrain.memory import host

    monkeypatch.setattr(host, "clear_cuda_error", lambda: cleared.append(True))
    with pytest.raises(RuntimeError, match=r"cudaHostRegister failed \(712\) for 64 elements"):
        offload.host_buffer(64, torch.float32, pinned=True)
    assert cleared == [True] and not offload._REGISTERED


# ----------------------------------------------------------------------------- minor


def test_resharded_parameters_share_one_nan_per_dtype_and_device():
    """zero/unit.py: every reshard pointed the parameters at a freshly filled NaN; now
    one cached NaN per (dtype, device) serves every unit, still reading as NaN."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT
    from zerotrain.zero.unit import nan_fill

    from zero_harness import batches, local_batch, make_config

    cfg = make_config({"zero": {"stage": 3, "param_persistence_threshold": 0}}, 1, 3)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    for X, Y in batches(2):
        eng.backward(eng(*local_batch(X, Y, 0, 1, cfg.data.micro_batch_size)))
        eng.step()
    params = list(eng.module.parameters())
    nan = nan_fill(params[0].dtype, torch.device("cpu"))
    assert len(eng.strategy.units) > 2
    assert {p.data_ptr() for p in params} == {nan.data_ptr()}
    assert all(torch.isnan(p).all() for p in params)
    eng.close()


# ----------------------------------------------------------------------------- N11


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports `is_cuda` (what newton_schulz branches on)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_newton_schulz_uses_tf32_on_cuda_only_when_asked(monkeypatch):
    """N11: in bf16 runs Muon's Newton–Schulz GEMMs (fp32 buffers) ran as IEEE fp32 on
    CUDA — `tf32: auto` leaves half-precision runs alone. The engine now asks for TF32
    locally there; CPU numerics are bit-identical and the caller's setting is restored."""
    from zerotrain.optim import muon as M

    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(M.newton_schulz(g, tf32=True), M.newton_schulz(g))  # CPU unchanged
    seen: list[bool] = []
    real = M.tf32_matmuls

    def spy(on: bool):
        seen.append(on)
        return real(on)

    monkeypatch.setattr(M, "tf32_matmuls", spy)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        M.newton_schulz(g, tf32=True)
        M.newton_schulz(g.as_subclass(_OnCuda), tf32=False)
        M.newton_schulz(g.as_subclass(_OnCuda), tf32=True)
        assert seen == [False, False, True]  # TF32 only for a CUDA tensor, when asked
        with real(True):
            inside = torch.get_float32_matmul_precision()
        assert inside == "high" and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_engine_asks_for_tf32_newton_schulz_in_half_precision_runs():
    from zerotrain.config import build_config
    from zerotrain.engine import group_hyperparameters
    from zerotrain.models.plan import Group

    def ns_tf32(**precision):
        cfg = build_config({"optimizer": {"name": "muon"}, "precision": precision})
        return group_hyperparameters(cfg)[int(Group.MATRIX)]["ns_tf32"]

    assert ns_tf32(dtype="bf16") is True
    assert ns_tf32(dtype="bf16", tf32=False) is False  # IEEE asked for explicitly
    assert ns_tf32(dtype="fp32") is False  # fp32 runs: precision.tf32 applies globally


# ----------------------------------------------------------------------------- N6


def _slow_rank0_checkpoint(tmp: str, port: int) -> dict:
    """Reopen the group as `zerotrain train` does (its rendezvous store, a 2 s timeout),
    then save a checkpoint whose rank-0 finishing takes 4 s."""
    import os
    import time

    import torch.distributed as dist

    from zerotrain.checkpoint import io
    from zerotrain.comm import dist as zdist

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    zdist.init_distributed("cpu", "gloo", timeout_s=2)
    real = io._finish

    def slow_finish(*args, **kwargs):
        time.sleep(4)
        return real(*args, **kwargs)

    io._finish = slow_finish
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    final = io.save_sharded(tmp, 1, rank, world, {"w": torch.full((4,), float(rank))},
                            {"rank": rank}, {"run_id": "x"}, keep=2)
    waited = time.monotonic() - t0
    x = torch.ones(1)
    dist.all_reduce(x)  # the group is still healthy after the long solo wait
    return {"final": str(final), "waited": waited, "sum": float(x)}


def test_rank0_checkpoint_finishing_may_outlast_the_collective_timeout(tmp_path):
    """N6: rank 0 alone writes meta.json, renames and prunes, while the others waited in
    a collective barrier bound by comm.timeout_s (on NCCL a timeout aborts the process).
    They now wait on the rendezvous store: 4 s of finishing under a 2 s timeout."""
    from multirank import free_port, run_ranks

    r0, r1 = run_ranks(_slow_rank0_checkpoint, 2, str(tmp_path), free_port())
    assert r1["waited"] > 3.5 and r0["sum"] == r1["sum"] == 2.0
    assert r0["final"] == r1["final"] == str(tmp_path / "step_00000001")
    assert (tmp_path / "step_00000001" / "meta.json").is_file()


# ----------------------------------------------------------------------------- N4


def test_zero3_cuda_init_bound_by_hand():
    """N4: ZeRO-3's per-parameter init makes each unit's full buffer empty (for the first
    gather); on a CPU its pages are never touched, but on CUDA the caching allocator hands
    the block out whole, and the never-zeroed gradient shard is resident too. Mixed
    precision, N = 2, units of 10 and 6 elements (shards 5 + 3 = 8), widest parameter 4:
    params 2·8 + grads 2·8 + master 4·8 = 64 bytes before Adam's states exist."""
    from zerotrain.memory import BytesPerParam, RunShape, phase_estimates

    mixed = BytesPerParam(params=2, grads=2, master=4, optimizer=8)
    cuda = phase_estimates(RunShape.for_stage([10, 6], 2, 3, mixed, largest_unit=10,
                                              init_piece=4))
    cpu = phase_estimates(RunShape.for_stage([10, 6], 2, 3, mixed, largest_unit=10,
                                             init_piece=4, lazy_grads=True))
    assert cuda["init"] == 64 + 2 * 4 + 2 * 10  # + scratch parameter + one unit buffer
    assert cpu["init"] == 64 - 16 + 2 * 4      # no gradient shard, no unit buffer pages
    assert cuda["step"] == cpu["step"]


def test_the_estimator_states_the_cuda_init_bound():
    """`zerotrain estimate` for a CUDA run: init = shard + master + gradient shard +
    widest parameter + largest unit, each from the model's own buffers."""
    from zerotrain.cli.estimate import predict_peaks
    from zerotrain.config import build_config
    from zerotrain.memory.states import shard_numel
    from zerotrain.models import build_model

    cfg = build_config({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
                        "precision": {"dtype": "bf16"}})
    widest = max(p.numel() for p in build_model(cfg.model, device="meta").parameters())
    got = predict_peaks(cfg, 2, 3, device="cuda")
    numels = got["buffer_numels"]
    own = sum(shard_numel(n, 2) for n in numels)
    assert got["baseline"] == 0
    assert got["phases"]["init"] == own * (2 + 4 + 4) + 2 * (widest + max(numels))


# ----------------------------------------------------------------------------- N10


def _preempted_on_rank_one(tmp: str) -> dict:
    """Train at 2 ranks; rank 1 alone gets a 'SIGTERM' during step 2."""
    from pathlib import Path

    import torch.distributed as dist

    import zerotrain.run.loop as T
    from zerotrain.comm.collectives import Comm
    from zerotrain.run.lifecycle import Interrupted

    from zero_harness import run_config

    rank = dist.get_rank()

    class SignalAtStep2(T.Preemption):
        reads = 0

        @property
        def requested(self) -> bool:
            SignalAtStep2.reads += 1
            return rank == 1 and SignalAtStep2.reads >= 2  # read once per step

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    votes: list[tuple[str, bool]] = []
    real = Comm.all_reduce

    def spy(self, tensor, *, purpose="grads", async_op=False):
        if purpose == "control":
            votes.append((purpose, async_op))
        return real(self, tensor, purpose=purpose, async_op=async_op)

    T.Preemption, Comm.all_reduce = SignalAtStep2, spy
    cfg = run_config(Path(tmp), "run", 50, every=0)
    try:
        T.train(cfg)
        return {"interrupted": None}
    except Interrupted as e:
        return {"interrupted": e.step, "message": str(e), "votes": votes}


def test_the_preemption_vote_is_async_and_every_rank_stops_together(tmp_path):
    """N10: the per-step preemption vote was a blocking all-reduce (host → device, NCCL,
    device → host: the device queue drained at every step boundary). It is now cast
    without waiting and read at the next step: a signal during step 2 on one rank stops
    every rank after step 3, with a checkpoint there to resume from."""
    from multirank import run_ranks
    from zero_harness import corpus

    corpus(tmp_path)
    r0, r1 = run_ranks(_preempted_on_rank_one, 2, str(tmp_path))
    assert r0["interrupted"] == r1["interrupted"] == 3, (r0, r1)
    assert r0["votes"] == r1["votes"] == [("control", True)] * 2  # steps 1, 2: async
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000003" and "checkpoint saved" in r0["message"]


# ----------------------------------------------------------------------------- N8


def test_quantize_without_counts_is_the_same_cast():
    from zerotrain.numerics.formats import FP8_E4M3, FP8_E5M2
    from zerotrain.numerics.fp8 import amax, quantize, scale_from_amax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * 30
    x[0, :5] = 1e-9  # underflows
    inputs = (x, x.bfloat16())
    before = [t.clone() for t in inputs]
    for t in inputs:
        for fmt in (FP8_E4M3, FP8_E5M2):
            s = scale_from_amax(amax(t) / 4, fmt)  # a scale that overflows, as delayed may
            for saturate in (True, False):
                s_ = s if saturate else scale_from_amax(amax(t), fmt)
                q, counts = quantize(t, s_, fmt, saturate=saturate)
                q2, none = quantize(t, s_, fmt, saturate=saturate, count=False)
                assert none is None and counts is not None
                assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))  # never scaled in place


def _fp8_engine_run(count_every: int) -> dict:
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import batches, local_batch, make_config

    cfg = make_config({"precision": {"dtype": "bf16", "fp8": {
        "enabled": True, "recipe": "delayed", "amax_history": 4,
        "count_every": count_every}}}, 1, 4)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    infos, losses = [], []
    for X, Y in batches(4):
        loss = eng(*local_batch(X, Y, 0, 1, cfg.data.micro_batch_size))
        eng.backward(loss)
        infos.append(eng.step().fp8)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    eng.close()
    return {"fp8": infos, "losses": losses, "params": params}


def test_fp8_counts_only_on_counted_steps_and_nothing_else_changes():
    """N8: the overflow/underflow counts cost extra passes per cast and a sync plus an
    all-reduce per step; they are now taken every `count_every` steps (default: the
    logged ones). Training is bit-identical and a counted step's counts are the same."""
    every, some = _fp8_engine_run(1), _fp8_engine_run(3)
    assert some["losses"] == every["losses"]
    assert all(torch.equal(every["params"][k], some["params"][k]) for k in every["params"])
    assert [c is None for c in some["fp8"]] == [True, True, False, False]  # steps 3, 4 (last)
    assert some["fp8"][2] == every["fp8"][2] and some["fp8"][3] == every["fp8"][3]
    assert all(c is not None for c in every["fp8"])


# ----------------------------------------------------------------------------- on a GPU

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_no_cuda
def test_fp8_refresh_with_cuda_shards_at_two_ranks():
    """N1 on the real device: the CPU stand-in's verdict, checked against CUDA itself."""
    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params.fp8_wire import Fp8Wire, refresh_all
    from zerotrain.zero.partition import Partition

    a, b = (nn.Parameter(torch.randn(64, 64)) for _ in range(2))
    u = FlatUnit.build(0, "blk", [("blk.q.weight", a, 0), ("blk.o.weight", b, 0)],
                       Partition(2, 0), align=8)
    u.wire = Fp8Wire(u, {"blk.q.weight", "blk.o.weight"}, 2)
    u.shard = torch.zeros(u.shard_numel, dtype=torch.bfloat16, device="cuda")
    refresh_all([u], _HostComm())
    assert u.wire.send.device.type == "cuda"


@pytest.mark.gpu
@_no_cuda
def test_a_dropped_pinned_buffer_can_be_registered_again():
    """N9 on the real driver: memory freed without close() is unregistered, so the next
    registration at the same addresses succeeds (it failed with 712 before)."""
    import gc

    from zerotrain.zero.states import host as offload

    for _ in range(20):
        t = offload.host_buffer(1 << 16, torch.float32, pinned=True)
        assert t.is_pinned()
        del t
        gc.collect()
    assert not offload._REGISTERED
