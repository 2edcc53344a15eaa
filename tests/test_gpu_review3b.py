"""The fourth GPU review (`shared/findings/gpu-review-3.md`): streams, leaks, slow paths
and hangs (W-2, W-3, C-1, N6', H-2, L-1..L-4, S-1..S-6).

The GPU mechanisms are shown on the CPU by the contract they break: recorded stream
calls, spies on what torch is handed, counters; each has a `gpu` test beside it that
runs the real thing where CUDA is present.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.config import ModelConfig
from zerotrain.models import checkpointing
from zerotrain.models.checkpointing import HOST_COPIES, HostStash, apply_checkpointing
from zerotrain.models.gpt import GPT

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------- W-2
class _Log:
    """`HostStash`'s CUDA calls stood in for, logging their order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        log = self.log

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_stream(self, other) -> None:
                log.append(("wait_stream", self.name, other.name))

            def wait_event(self, ev) -> None:
                log.append(("wait_event", self.name))

        class Event:
            def record(self, stream) -> None:
                log.append(("record", stream.name))

        self.Stream, self.Event = Stream, Event

    def side(self, device):
        return self.Stream("side")

    def current(self, device):
        return self.Stream("current")

    def on(self, stream):
        self.log.append(("on", stream.name))
        return contextlib.nullcontext()

    def event(self):
        return self.Event()

    def host_like(self, x):
        return HOST_COPIES.host_like(x)

    def device_like(self, t, device):
        self.log.append(("device_like",))
        return HOST_COPIES.device_like(t, device)

    def keep(self, t, stream) -> None:
        self.log.append(("keep", stream.name))

    def recycle(self, host) -> None:
        self.log.append(("recycle",))


def test_stash_fetch_orders_its_write_after_the_compute_stream():
    """W-2: the block `fetch` allocates belongs to the compute stream's pool and may have
    been freed (in host order) while a reader is still queued there; the side stream
    must wait for the compute stream before its copy writes the block."""
    rt = _Log()
    x = torch.randn(4, 8)
    stash = HostStash(x, rt)
    HostStash._last = None
    assert stash.get() is x  # forward
    rt.log.clear()
    back = stash.get()  # the recompute: fetch, then the current stream waits
    assert torch.equal(back, x)
    at = rt.log.index(("device_like",))
    copy_at = rt.log.index(("on", "side"), at)
    assert ("wait_stream", "side", "current") in rt.log[at + 1 : copy_at], rt.log


@pytest.mark.gpu
@needs_cuda
def test_stash_fetch_does_not_overwrite_a_pending_reader_gpu():
    """The allocator race itself: a tensor freed while its reader is queued behind a
    sleep, its block handed to `fetch`; the reader must still see its own bytes."""
    n = 1 << 22
    stash = HostStash(torch.full((n,), 7.0, device="cuda"), checkpointing.CUDA_COPIES)
    HostStash._last = None
    stash.get()
    torch.cuda.synchronize()
    a = torch.ones(n, device="cuda")
    torch.cuda._sleep(100_000_000)
    b = a * 2  # queued behind the sleep
    del a  # its block goes back to the compute stream's pool at once
    back = stash.get()
    torch.cuda.synchronize()
    assert bool((back == 7).all())
    assert bool((b == 2).all())


# ----------------------------------------------------------------------------- W-3
def _tiny_gpt(dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=dropout))


def test_checkpoint_names_the_blocks_device_for_rng_replay(monkeypatch):
    """W-3: torch's checkpoint saves the RNG state of the devices of its positional
    tensors only; the offload path passes `None` for the hidden state, so on CUDA it
    saved none and dropout drew other masks in the recompute. Every checkpointed call
    must hand torch a positional tensor on the hidden state's device."""
    seen: list[set] = []
    real = checkpointing.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append({a.device for a in args if isinstance(a, torch.Tensor)})
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "checkpoint", spy)
    for mode in ("offload", True):
        seen.clear()
        model = _tiny_gpt(0.1)
        apply_checkpointing(model.blocks, mode, force_stash=True)
        HostStash._last = None
        x = torch.randint(0, 256, (2, 16))
        model(x, x).backward()
        assert len(seen) == 2 and all(torch.device("cpu") in s for s in seen), (mode, seen)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["offload", True])
def test_checkpointed_dropout_gradients_equal_plain_gpu(mode):
    """W-3 on CUDA: with dropout, checkpointed (and offloaded) blocks give the plain
    model's gradients (the recompute replays forward's masks)."""
    grads = []
    for m in (False, mode):
        model = _tiny_gpt(0.2).cuda().train()
        apply_checkpointing(model.blocks, m)
        HostStash._last = None
        torch.manual_seed(1)
        torch.cuda.manual_seed(1)
        x = torch.randint(0, 256, (2, 16), device="cuda")
        model(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- N6'
def _slow_io_run(tmp: str, port: int) -> dict:
    """`zerotrain train`'s setup and one checkpoint on a group whose collectives time out
    after 2 s, while rank 0's clearing of the old run and rank 1's shard write each take
    4 s (a slow shared filesystem, lazy NVMe-tier states)."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from zerotrain.checkpoint import io
    from zerotrain.comm import dist as zdist
    from zerotrain.run import setup as run_setup

    from zero_harness import run_config

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    zdist.init_distributed("cpu", "gloo", timeout_s=2)
    rank = dist.get_rank()
    real_clear, real_write = run_setup.clear_run, io._write_rank

    def slow_clear(cfg):
        time.sleep(4)
        return real_clear(cfg)

    def slow_write(tmp_dir, r, *a, **k):
        if r == 1:
            time.sleep(4)
        return real_write(tmp_dir, r, *a, **k)

    run_setup.clear_run, io._write_rank = slow_clear, slow_write
    run = run_setup.setup(run_config(Path(tmp), "run", 2, layers=1), None)
    path = run.save()
    x = torch.ones(1)
    dist.all_reduce(x)  # the group is healthy after the long solo waits
    run.report.close()
    return {"path": str(path), "sum": float(x), "rank": rank}


def test_io_barriers_outlast_the_collective_timeout(tmp_path):
    """N6': the barriers around rank 0's clearing of an old run (setup) and around every
    rank's checkpoint write were collectives bounded by comm.timeout_s — on NCCL the
    watchdog aborts. They wait on the store now: 4 s of I/O under a 2 s timeout."""
    from multirank import free_port, run_ranks

    r0, r1 = run_ranks(_slow_io_run, 2, str(tmp_path), free_port(), timeout=120)
    assert r0["sum"] == r1["sum"] == 2.0
    assert r0["path"] == r1["path"] and "step_" in r0["path"]


# ----------------------------------------------------------------------------- C-1
def _gathered_before_initialize_nccl_like() -> list:
    """zero.Init + GatheredParameters(modifier_rank=0) before initialize, where the group
    takes device tensors only (NCCL's contract, `simdevice.py`'s stand-in device)."""
    import torch.distributed as dist

    import zerotrain.deepspeed as deepspeed
    from simdevice import SIM, SimDevice, SimTensor
    from zerotrain.deepspeed import zero

    real, devices = dist.broadcast, []

    def broadcast(tensor, src, group=None, async_op=False):
        devices.append(tensor.device.type)
        if not isinstance(tensor, SimTensor):
            raise RuntimeError("No backend type associated with device type cpu")
        return real(tensor.inner, src=src, group=group, async_op=async_op)

    dist.broadcast = broadcast
    zero.comm_device = lambda group=None: SIM
    rank = dist.get_rank()
    with deepspeed.zero.Init():
        net = nn.Linear(4, 3)
    with SimDevice(), torch.no_grad(), \
            deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=0):
        net.weight.fill_(1.0 if rank == 0 else 5.0)
        net.bias.fill_(2.0 if rank == 0 else 6.0)
    pending = zero.take_pending(net)
    return [devices, {k: (v.tolist() if v is not None else None, src)
                      for k, (v, src) in pending.items()}]


def test_gathered_parameters_before_initialize_broadcast_on_the_groups_device():
    """C-1: before initialize the parameters are host tensors; the broadcast to the other
    ranks must go through the device the group's backend takes (NCCL: the GPU)."""
    from multirank import run_ranks

    # the values stay with the modifier rank until initialize hands them out (sliced:
    # docs/hf.md); nothing is broadcast before, so no CPU tensor meets the backend here
    for rank, (devices, pending) in enumerate(run_ranks(_gathered_before_initialize_nccl_like,
                                                        2)):
        assert devices == []
        assert pending == ({"weight": ([[1.0] * 4] * 3, 0), "bias": ([2.0] * 3, 0)} if rank == 0
                           else {"weight": (None, 0), "bias": (None, 0)})


def _hand_out_broadcast_device() -> list[str]:
    import torch.distributed as dist

    from zerotrain.deepspeed import pending

    real, devices = dist.broadcast, []

    def broadcast(tensor, src, group=None, async_op=False):  # a spy: where it is sent from
        devices.append(tensor.device.type)

    dist.broadcast = broadcast
    pending.comm_device = lambda group=None: torch.device("meta")  # the backend's device
    try:
        pending._broadcast_one(torch.ones(3) if dist.get_rank() == 0 else None, 0,
                               torch.empty(3))
    finally:
        dist.broadcast = real
    return devices


def test_initialize_hands_out_pending_values_from_the_groups_device():
    """C-1 at initialize: the pending values go out from the group's device."""
    from multirank import run_ranks

    for devices in run_ranks(_hand_out_broadcast_device, 2, fresh=True):
        assert devices == ["meta"]


# ----------------------------------------------------------------------------- S-4
class _HostComm:
    """A one-rank stand-in for Comm's control reduction: fp64 back on the CPU, as the
    real one returns it."""

    device = torch.device("cpu")

    def all_reduce_scalars(self, t, op="sum"):
        return t.detach().to("cpu", torch.float64)


def test_fp8_refresh_hands_each_piece_a_device_amax(monkeypatch):
    """S-4: the all-reduced amaxes come back on the CPU; each FP8 piece's scale then
    copied its own 0-d amax to the device (pageable: one stream sync per piece per
    step). They go back to the shards' device once, before the pieces are packed."""
    from simdevice import SimDevice
    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params import fp8_wire
    from zerotrain.zero.params.fp8_wire import Fp8Wire, refresh_all
    from zerotrain.zero.partition import Partition

    seen, real = [], fp8_wire.quantize_shard

    def spy(shard, amax, *a, **k):
        seen.append(amax.device.type)
        return real(shard, amax, *a, **k)

    monkeypatch.setattr(fp8_wire, "quantize_shard", spy)
    g = torch.Generator().manual_seed(0)
    a, b = (nn.Parameter(torch.randn(64, 64, generator=g)) for _ in range(2))
    u = FlatUnit.build(0, "blk", [("blk.q.weight", a, 0), ("blk.o.weight", b, 0)],
                       Partition(2, 0), align=8)
    u.wire = Fp8Wire(u, {"blk.q.weight", "blk.o.weight"}, 2)
    full = torch.cat([a.detach().flatten(), b.detach().flatten()]).bfloat16()
    lo, hi = u.shard_range
    with SimDevice():
        u.shard = full[lo:hi].clone().to("meta")
        refresh_all([u], _HostComm())
    assert seen and set(seen) == {"meta"}, seen


# ----------------------------------------------------------------------------- L-3
class _Ops(TorchDispatchMode):
    """The aten ops run, and the dtypes of the tensors they make."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.made: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.__name__)
        if isinstance(out, torch.Tensor):
            self.made.add(out.dtype)
        return out


def test_fp8_gather_decodes_natively_off_the_cpu_and_exactly():
    """L-3: on an accelerator the gathered FP8 bytes were decoded by table — an int32
    index tensor and an fp32 gather, 8 B/element transient. Off the CPU the native cast
    goes straight into the output (no int32, no index_select) with the table's bits, for
    every byte, power-of-two scales wide and narrow, each parameter dtype."""
    from simdevice import SimDevice
    from zerotrain.numerics.fp8_gather import dequantize

    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for scale in (2.0**-6, 1.0, 32.0, 2.0**20):
            s = torch.tensor(scale)
            want = dequantize(q, s, dtype)
            with SimDevice():
                qd, sd = q.to("meta"), s.to("meta")
                out = torch.empty(256, dtype=dtype).to("meta")
                with _Ops() as ops:
                    got = dequantize(qd, sd, dtype, out=out)
                got = got.cpu()
            assert torch.equal(got.view(-1).float().nan_to_num(7.0),
                               want.float().nan_to_num(7.0)), (dtype, scale)
            assert "index_select.default" not in ops.ops and torch.int32 not in ops.made
            if dtype != torch.float16:
                assert torch.float32 not in ops.made or dtype == torch.float32, ops.ops


@pytest.mark.gpu
@needs_cuda
def test_fp8_gather_native_decode_equals_the_table_gpu():
    from zerotrain.numerics.fp8_gather import dequantize

    q = torch.randint(0, 256, (1 << 20,), dtype=torch.int32).to(torch.uint8)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        s = torch.tensor(64.0)
        want = dequantize(q, s, dtype)
        got = dequantize(q.cuda(), s.cuda(), dtype).cpu()
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))


# ----------------------------------------------------------------------------- L-1
def test_offloaded_activations_reuse_exact_size_pinned_buffers(monkeypatch):
    """L-1: each stashed block input took pinned memory from torch's caching host
    allocator (rounded up to a power of two, kept for the process's life, not released
    by close). Now exact-size registered buffers from a pool: one per block, reused by
    the next step, given back when the engine closes."""
    from zerotrain.memory import host

    made, released = [], []

    def fake_buffer(numel, dtype, pinned):
        assert pinned
        made.append(numel)
        return torch.zeros(numel, dtype=dtype)

    monkeypatch.setattr(host, "host_buffer", fake_buffer)
    monkeypatch.setattr(host, "release_host_buffer", lambda t: released.append(t.numel()))
    pool = host.PinnedPool()
    monkeypatch.setattr(host, "PINNED", pool)
    monkeypatch.setattr(checkpointing, "PINNED", pool)

    class PooledHost(checkpointing.HostCopies):  # the CUDA path's host side
        host_like = checkpointing.CudaCopies.host_like
        recycle = checkpointing.CudaCopies.recycle

    monkeypatch.setattr(checkpointing, "HOST_COPIES", PooledHost())
    model, plain = _tiny_gpt(0.0), _tiny_gpt(0.0)
    apply_checkpointing(model.blocks, "offload", force_stash=True)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        HostStash._last = None
        model.zero_grad()
        model(x, x).backward()
    plain(x, x).backward()
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=n)
    assert made == [2 * 16 * 32] * 2  # exact size, one per block, made once
    assert pool.made == 2 and len(pool.free[(2 * 16 * 32, torch.float32)]) == 2
    pool.release()
    assert released == [2 * 16 * 32] * 2 and not pool.free


def test_engine_close_releases_the_pinned_pool(monkeypatch):
    from zerotrain.engine import Engine
    from zerotrain.memory import host

    from zero_harness import make_config

    calls = []
    monkeypatch.setattr(host.PINNED, "release", lambda: calls.append(True))
    cfg = make_config({"zero": {"stage": 0}}, 1, 4)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    eng.close()
    assert calls == [True]


@pytest.mark.gpu
@needs_cuda
def test_offloaded_activations_pinned_pool_gpu():
    from zerotrain.memory import host

    model = _tiny_gpt(0.0).cuda()
    apply_checkpointing(model.blocks, "offload")
    x = torch.randint(0, 256, (2, 16), device="cuda")
    before = host.PINNED.made
    for _ in range(3):
        HostStash._last = None
        model(x, x).backward()
    torch.cuda.synchronize()
    assert host.PINNED.made - before <= 2
    host.PINNED.release()
    assert not host.PINNED.free


# ----------------------------------------------------------------------------- L-4
def test_an_evaluation_forward_keeps_no_document_mask():
    """L-4: the dense [B,1,T,T] document mask of an evaluation forward (no backward to
    come) stayed referenced until the next training forward; it goes at once now, and
    an evaluation between a training forward and its backward leaves that one's alone."""
    from zerotrain.models.documents import DocumentMasking, attention_mask_for

    model = _tiny_gpt(0.0)
    masking = DocumentMasking(3, model)
    x = torch.randint(4, 256, (2, 16))
    x[:, 5] = 3
    held = []

    def call(idx, targets):
        held.append(attention_mask_for(torch.zeros(2, 2, 16, 8)))
        return model(idx, targets)

    loss = masking.forward(call, (x, x), {})
    train_docs = masking.last
    assert train_docs is not None and train_docs._masks
    with torch.no_grad():
        masking.forward(call, (x, x), {})
    assert held[1] is not None and held[1] is not held[0]
    assert masking.last is train_docs and train_docs._masks  # the training one kept
    with masking.backward_context():
        loss.backward()
    assert not train_docs._masks
    with torch.no_grad():
        masking.forward(call, (x, x), {})
    assert masking.last is train_docs and not train_docs._masks  # nothing new held


# ----------------------------------------------------------------------------- H-2
def _crossed_communicators(port: int) -> str:
    """Two communicators (the world's, a sequence-parallel split) issued in different
    orders on the two ranks, under comm.check_lockstep and a 5 s collective timeout."""
    import os

    import torch.distributed as dist

    from zerotrain.comm import dist as zdist
    from zerotrain.comm.collectives import Comm
    from zerotrain.comm.lockstep import LockstepError

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    zdist.init_distributed("cpu", "gloo", timeout_s=5)
    comm = Comm("native", check_lockstep=True, timeout_s=5)
    sp = comm.split(2)
    world = lambda: comm.all_reduce(torch.ones(4), purpose="other")  # noqa: E731
    seq = lambda: sp.all_reduce(torch.ones(4), purpose="sequence")  # noqa: E731
    try:
        for fn in ((world, seq) if dist.get_rank() == 0 else (seq, world)):
            fn()
    except LockstepError as e:
        return f"LockstepError: {e}"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        comm.close()
    return "ok"


def test_lockstep_names_communicators_issued_in_different_orders():
    """H-2: ZeRO-3's gathers, the gradient group and the sequence-parallel group run
    concurrently from one thread; each communicator checked its own sequence, so two
    ranks issuing them in different orders were not compared (the checks themselves
    hung). The split groups now join the world's sequence: one error, both named."""
    from multirank import free_port, run_ranks

    for msg in run_ranks(_crossed_communicators, 2, free_port(), timeout=120):
        assert msg.startswith("LockstepError"), msg
        assert "other" in msg and "sequence on the 2-rank split groups" in msg, msg



# ----------------------------------------------------------------------------- L-2
def test_gathered_parameters_after_initialize_gathers_only_their_units(monkeypatch):
    """L-2: `GatheredParameters([one weight])` after initialize gathered every unit of
    the model on every rank (OOM for a model larger than one GPU) and, with
    `modifier_rank`, re-read every unit's master. Now only the units holding the named
    parameters are gathered and written; the edit lands, the rest is untouched."""
    import zerotrain.deepspeed as deepspeed
    from zerotrain.zero.unit import ShardedUnit

    net = _tiny_gpt(0.0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    eng, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    units = eng.strategy.units
    assert len(units) > 2
    target = net.blocks[1].mlp.fc.weight
    owner = next(u for u in units if any(s.param is target for s in u.slots))
    gathered, real = [], ShardedUnit.unshard

    def unshard(self, *a, **k):
        gathered.append(self.index)
        return real(self, *a, **k)

    monkeypatch.setattr(ShardedUnit, "unshard", unshard)
    masters = [u.master.clone() for u in units]
    with deepspeed.zero.GatheredParameters([target], modifier_rank=0), torch.no_grad():
        assert target.shape == (128, 32)
        target.fill_(0.5)
    assert gathered == [owner.index]
    with deepspeed.zero.GatheredParameters([target]):
        assert bool((target == 0.5).all())
    for u, before in zip(units, masters):
        if u is not owner:
            assert torch.equal(u.master, before)
    eng.close()



def _init_opens_the_group(port: int) -> list:
    """A DeepSpeed script that relies on `zero.Init` to open the group (DeepSpeed's
    does), then loads rank 0's weights before initialize."""
    import os

    import torch.distributed as dist

    import zerotrain.deepspeed as deepspeed
    from zerotrain.deepspeed import zero

    rank = dist.get_rank()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    with deepspeed.zero.Init():
        net = nn.Linear(2, 2)
    opened = dist.is_initialized()
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(net.parameters()),
                                                            modifier_rank=0):
        net.weight.fill_(1.0 if rank == 0 else 5.0)
        net.bias.fill_(2.0 if rank == 0 else 6.0)
    return [opened, {k: (v.tolist() if v is not None else None, src)
                      for k, (v, src) in zero.take_pending(net).items()}]


def test_zero_init_opens_the_group_as_deepspeeds_does():
    """C-1's neighbour: without a group, GatheredParameters broadcast nothing and every
    rank kept its own values (silently). zero.Init opens it, as DeepSpeed's does."""
    from multirank import free_port, run_ranks

    for rank, (opened, pending) in enumerate(run_ranks(_init_opens_the_group, 2, free_port(),
                                                       timeout=120)):
        assert opened  # so the modifier rank is one rank of a group, not each its own
        assert pending == ({"weight": ([[1.0, 1.0]] * 2, 0), "bias": ([2.0, 2.0], 0)}
                           if rank == 0 else {"weight": (None, 0), "bias": (None, 0)})


# ----------------------------------------------------------------------------- S-5
class _Syncs(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (`.item()`, `bool()`, `float()`):
    on a GPU each one waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


class _SumGroup:
    """A two-rank group whose other rank contributes `other` (what gloo/NCCL would sum)."""

    device = torch.device("cpu")

    def __init__(self, other: float) -> None:
        self.other = other

    def all_reduce(self, t, purpose="grads", async_op=False):
        t.add_(self.other)

    def all_reduce_scalars(self, t, op="sum"):
        return t.detach().double().cpu() + self.other


@pytest.mark.parametrize("mine", [3.0, 0.0])
def test_sequence_parallel_loss_needs_no_host_sync(mine):
    """S-5: the whole-batch loss under sequence parallelism read device values on the
    host three times per micro-step (the empty-slice branch, the reduced value back on
    the host, and again up to the device); none now, with the same value and gradient
    (an empty slice: share 0, finite gradient)."""
    from zerotrain.models.ulysses import SequenceParallel

    sp = SequenceParallel.__new__(SequenceParallel)
    sp.group = _SumGroup(0.75)
    import torch.nn.functional as F

    x = torch.tensor([[1.5, 2.5]], requires_grad=True)
    target = torch.tensor([1 if mine else -100])  # an SFT prompt: nothing to predict
    local = F.cross_entropy(x, target, ignore_index=-100)
    counts = torch.tensor([mine, 4.0], dtype=torch.float64)
    with _Syncs() as syncs:
        loss = sp._whole_loss(local, counts)
        loss.backward()
    assert syncs.n == 0
    ref = x.detach().clone().requires_grad_()
    (F.cross_entropy(ref, torch.tensor([1])) * (mine / 4.0)).backward()
    want_loss = float(F.cross_entropy(ref.detach(), torch.tensor([1]))) * mine / 4.0 + 0.75
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-6, atol=0)
