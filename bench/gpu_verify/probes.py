"""Probes of the GPU reviews' claims over one NCCL rank (bench/gpu_check.sh, section probes).

    torchrun --standalone --nproc-per-node 1 bench/gpu_verify/probes.py --out DIR
    torchrun --standalone --nproc-per-node 2 bench/gpu_verify/probes.py --out DIR --dry-run

Each probe records one row, PASS / FAIL / SKIP, or for a defect a review predicted and
another change may have fixed, REPRODUCED / FIXED (judged from the behaviour, never from a
version number), into DIR/probes.json. `--dry-run` runs every probe it can on CPU ranks
over gloo with stand-ins (named in the row's detail): the ring exchange between two CPU
ranks for NCCL's self exchange, the meta device for CUDA shards, patched device counts.
The probes that provoke CUDA errors (N2, N9) run last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

ROWS: list[dict] = []
DRY = False


def row(probe: str, status: str, detail: str = "") -> None:
    ROWS.append({"check": probe, "status": status, "detail": detail})
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[probe] {status:10} {probe}: {detail}", flush=True)


def guarded(name: str, fn: Callable[[torch.device], None], dev: torch.device) -> None:
    """One probe's exception is its FAIL row; the others still run."""
    try:
        fn(dev)
    except Exception as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        row(f"{name}: probe raised", "FAIL", f"{type(e).__name__}: {first}")
        traceback.print_exc()


# ----------------------------------------------------------------------------- C1


def p_c1(dev: torch.device) -> None:
    from zerotrain.comm.collectives import Comm
    from zerotrain.comm.dist import comm_device

    name = "C1: control tensors go through the device; CPU tensors never reach NCCL"
    refused = "gloo stand-in: NCCL's refusal of CPU tensors is not tested"
    if dist.get_backend() == "nccl":
        try:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
            row(name, "FAIL", "NCCL accepted a CPU tensor (the premise of C1 does not hold)")
            return
        except (RuntimeError, ValueError) as e:
            refused = f"CPU tensor refused: {str(e).splitlines()[0][:100]}"
    world = dist.get_world_size()
    t = torch.ones(2, device=dev)
    dist.all_reduce(t)
    assert comm_device() == dev, (comm_device(), dev)
    out = Comm().all_reduce_scalars([1.0, 2.0])
    assert out.device.type == "cpu" and out.dtype == torch.float64, (out.device, out.dtype)
    assert out.tolist() == [float(world), 2.0 * world], out.tolist()
    row(name, "PASS", f"{refused}; comm device {comm_device()}; all_reduce_scalars -> CPU "
        "fp64" + (" (zerotrain's own collectives short-circuit at world size 1)"
                  if world == 1 else f" over {world} ranks"))


# ----------------------------------------------------------------------------- H1


def p_h1(dev: torch.device) -> None:
    from zerotrain.comm.ring import _exchange, _ring

    name = "H1: ring step through one batch_isend_irecv on a split group"
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(list(range(world)))  # an eager split of the default group, as Comm's
    n = 1 << (12 if DRY else 20)
    send = torch.arange(n, dtype=torch.float32, device=dev) + rank * n
    recv = torch.empty_like(send)
    ring = _ring(g)
    s, r = _exchange(ring, send, recv)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    prev = (rank - 1) % world
    assert torch.equal(recv, torch.arange(n, dtype=torch.float32, device=dev) + prev * n)
    assert s == r == n * 4
    how = ("NCCL self exchange at world size 1: the API path only; deadlock freedom across "
           "ranks needs >= 2 GPUs" if world == 1 else f"{world} ranks, {dist.get_backend()}")
    row(name, "PASS", how)


# ----------------------------------------------------------------------------- S3


def p_s3(dev: torch.device) -> None:
    from zerotrain.memory.host import host_buffer, release_host_buffer

    name = "S3: many small registered host buffers (neighbours share pages)"
    pinned = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 70_000, (400 if pinned else 40,), generator=g).tolist()
    bufs = [host_buffer(n, torch.float32 if i % 2 else torch.bfloat16, pinned)
            for i, n in enumerate(sizes)]  # consecutive heap blocks: they share pages
    try:
        assert all(b.is_pinned() == pinned for b in bufs), "is_pinned() is wrong"
        exact = 0
        for b in bufs[:50]:
            b.copy_(torch.arange(b.numel(), dtype=b.dtype))
            d = torch.empty(b.numel(), dtype=b.dtype, device=dev)
            d.copy_(b, non_blocking=pinned)
            back = host_buffer(b.numel(), b.dtype, pinned)
            back.copy_(d, non_blocking=pinned)
            if pinned:
                torch.cuda.synchronize()
            exact += bool(torch.equal(back, b))
            if pinned:
                release_host_buffer(back)
    finally:
        for b in bufs if pinned else ():
            release_host_buffer(b)
    assert exact == min(50, len(bufs)), f"{exact} exact round trips"
    row(name, "PASS", f"{len(sizes)} buffers (1..70k elements), is_pinned {pinned}, "
        f"{exact} async round trips exact" + ("" if pinned else " (CPU: unpinned path only)"))


# ----------------------------------------------------------------------------- FP8


def _fp8_capable(dev: torch.device) -> bool:
    return dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 9)


def _short(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.float8_")


def p_fp8(dev: torch.device) -> None:
    from zerotrain.numerics.fp8_mm import _emulate, _scaled, resolve_matmul, scaled_mm_out_dtype

    name = "FP8: _scaled_mm contract (layouts, scales, out dtypes) vs emulation"
    if not _fp8_capable(dev):
        row(name, "SKIP", f"capability {torch.cuda.get_device_capability(dev)}: needs sm_89+")
        return
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    g = torch.Generator(device=dev).manual_seed(0)
    M, K, N = (64, 96, 48) if DRY else (256, 512, 384)
    choice = "scaled_mm" if dev.type == "cpu" else "auto"  # auto emulates on the CPU
    done = []
    for a_dt, b_dt, rowwise in ((e4, e4, False), (e5, e4, False), (e4, e5, False),
                                (e4, e4, True), (e5, e4, True)):
        key = str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}"
        out_dt = scaled_mm_out_dtype(key, a_dt, b_dt, rowwise)
        a8 = (torch.randn(M, K, device=dev, generator=g) * 4).to(a_dt)
        b8 = (torch.randn(N, K, device=dev, generator=g) * 4).to(b_dt).t()  # column-major
        sa = torch.full((M, 1) if rowwise else (), 2.0, device=dev)
        sb = torch.full((1, N) if rowwise else (), 0.5, device=dev)
        tag = f"{_short(a_dt)}x{_short(b_dt)}{' rowwise' if rowwise else ''}"
        if resolve_matmul(choice, a8, b8, rowwise) != "scaled_mm":
            done.append(f"{tag}: emulated")
            continue
        ref = _emulate(a8, sa, b8, sb)
        got = _scaled(a8, sa, b8, sb, rowwise)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        tol = 1e-2 if out_dt == torch.bfloat16 else 1e-5
        assert err <= tol, f"{tag}: rel err {err:.2e} > {tol:g} (out {out_dt})"
        done.append(f"{tag}: out {str(out_dt).removeprefix('torch.')}, rel err {err:.0e}")
    if dev.type == "cuda":  # a dimension off the multiple of 16: emulated, not an error
        odd = torch.randn(100, 64, device=dev).to(e4)
        path = resolve_matmul("auto", odd, torch.randn(64, 64, device=dev).to(e4).t(), False)
        assert path == "emulate", path
        done.append("M=100 -> emulate")
    row(name, "PASS", "; ".join(done))


def p_fp8_recipes(dev: torch.device) -> None:
    from torch import nn

    from zerotrain.numerics.fp8 import FP8Recipe
    from zerotrain.numerics.fp8_linear import Fp8Linear

    name = "FP8 recipes: tensorwise / rowwise / delayed Fp8Linear fwd+bwd, scaled_mm vs emulate"
    if not _fp8_capable(dev):
        row(name, "SKIP", "needs sm_89+")
        return
    (b, t, i, o) = (2, 16, 64, 48) if DRY else (8, 256, 1024, 768)
    out = []
    for scaling in ("tensorwise", "rowwise", "delayed"):
        torch.manual_seed(0)
        lin = nn.Linear(i, o, bias=True, device=dev, dtype=torch.bfloat16)
        x = torch.randn(b, t, i, device=dev, dtype=torch.bfloat16)
        res = {}
        for mm in ("scaled_mm", "emulate"):
            m = Fp8Linear.from_linear(copy.deepcopy(lin), FP8Recipe(scaling=scaling, matmul=mm))
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            y.float().pow(2).mean().backward()
            res[mm] = (y.detach().float(), xi.grad.float(), m.weight.grad.float())
        errs = [float((a - c).norm() / c.norm()) for a, c in zip(res["scaled_mm"], res["emulate"])]
        assert max(errs) < 2e-2, f"{scaling}: rel diffs {errs}"
        out.append(f"{scaling} {max(errs):.0e}")
    row(name, "PASS", "max rel diff " + ", ".join(out))


# ----------------------------------------------------------------------------- N1


def p_n1(dev: torch.device) -> None:
    """refresh_all at a 2-rank layout: this rank misses some weights, whose default amax
    must be made on the shard's device (torch.stack refuses to mix devices)."""
    from torch import nn

    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params.fp8_wire import Fp8Wire, refresh_all
    from zerotrain.zero.partition import Partition

    name = "N1: ZeRO-3 FP8 all-gather refresh, 2-rank layout, device shards"
    shard_dev = torch.device("meta") if dev.type == "cpu" else dev  # meta: the CPU stand-in

    class OneRankComm:  # the layout is world 2; the MAX all-reduce is an identity here
        device = shard_dev

        def all_reduce_scalars(self, t, op="sum"):
            if t.device.type == "meta":  # values do not matter on the stand-in
                return torch.zeros(t.shape, dtype=torch.float64)
            return t.detach().to("cpu", torch.float64)

    a, b = nn.Parameter(torch.zeros(64, 64)), nn.Parameter(torch.zeros(64, 64))
    u = FlatUnit.build(0, "blk", [("q.weight", a, 0), ("o.weight", b, 0)], Partition(2, 0), 8)
    u.wire = Fp8Wire(u, {"q.weight", "o.weight"}, 2)
    u.shard = torch.randn(u.shard_numel).to(torch.bfloat16).to(shard_dev)
    where = "meta stand-in for CUDA" if shard_dev.type == "meta" else str(shard_dev)
    try:
        refresh_all([u], OneRankComm())
    except (RuntimeError, NotImplementedError) as e:
        frames = traceback.extract_tb(e.__traceback__)
        at_stack = any(f.name == "refresh_all" and "stack" in (f.line or "") for f in frames)
        msg = str(e).splitlines()[0][:160]
        if at_stack:
            row(name, "REPRODUCED", f"{where}: torch.stack mixes devices: {msg}")
        elif shard_dev.type == "meta":  # the stack passed; meta cannot run the rest
            row(name, "FIXED", f"{where}: the amax stack no longer mixes devices (later "
                f"meta-only limit: {msg})")
        else:
            raise
        return
    row(name, "FIXED", f"{where}: refresh_all packs with no device mix")


# ----------------------------------------------------------------------------- C2


def p_c2(dev: torch.device) -> None:
    from zerotrain.config import build_config
    from zerotrain.data.tokenizer import load_tokenizer
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT
    from zerotrain.run.loop import generate_text

    name = "C2: ZeRO-3 bf16 generation with a device generator, deterministic"
    cfg = build_config({"model": {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32},
                        "zero": {"stage": 3}, "precision": {"dtype": "bf16"},
                        "train": {"device": dev.type}})
    eng = Engine(GPT(cfg.model), cfg)
    try:
        tok = load_tokenizer("bytes")
        a = generate_text(eng, tok, "def ", 16, seed=3)
        b = generate_text(eng, tok, "def ", 16, seed=3)
    finally:
        eng.close()
    assert a == b and a.startswith("def "), (a, b)
    row(name, "PASS", f"{a[:20]!a} twice")


# ----------------------------------------------------------------------------- N2


@contextlib.contextmanager
def _env_and_gpus(env: dict[str, str], gpus: int) -> Iterator[None]:
    """These launcher variables, and torch seeing `gpus` GPUs (per-rank isolation)."""
    keys = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "SLURM_LOCALID",
            "OMPI_COMM_WORLD_LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    real = (torch.cuda.is_available, torch.cuda.device_count)
    try:
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(env)
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: gpus
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = real
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def p_n2(dev: torch.device) -> None:
    """pick_device where each rank sees only its own GPU, and where a launcher sets only
    RANK on a second node. REPRODUCED: a device index the process cannot use, or the
    launcher's 'more ranks than GPUs' refusal inside an isolated rank."""
    from zerotrain.comm import dist as zd

    name = "N2: device choice under per-rank GPU isolation and a RANK-only launcher"
    cases = [("isolated, torchrun vars", {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                                          "RANK": "3"}, 1),
             ("isolated, no LOCAL_WORLD_SIZE", {"LOCAL_RANK": "3", "RANK": "3"}, 1),
             ("second node, RANK only", {"RANK": "11"}, 8)]
    bad, good = [], []
    for what, env, gpus in cases:
        with _env_and_gpus(env, gpus):
            try:
                d = zd.pick_device("auto", zd.local_rank())
            except Exception as e:  # ConfigError and kin
                text = str(e).splitlines()[0][:90]
                clear = "LOCAL_RANK" in text or "CUDA_VISIBLE_DEVICES" in text
                (good if clear and gpus > 1 else bad).append(f"{what}: {text}")
                continue
        if d.type != "cuda" or (d.index or 0) >= gpus:
            bad.append(f"{what}: {d} with {gpus} visible")
        else:
            good.append(f"{what}: {d}")
            if dev.type == "cuda" and (d.index or 0) < torch.cuda.device_count():
                torch.empty(1, device=d)  # usable on this machine too
    stand_in = "patched device counts" + (" (CPU)" if dev.type == "cpu" else "")
    if bad:
        row(name, "REPRODUCED", f"{stand_in}: " + "; ".join(bad))
    else:
        row(name, "FIXED", f"{stand_in}: " + "; ".join(good))


# ----------------------------------------------------------------------------- N9


def _clear_last_cuda_error() -> None:
    """A failed runtime call leaves cudaGetLastError set and the next kernel-launch check
    would blame an unrelated op; torch's cudart binding cannot clear it (ctypes can)."""
    import ctypes

    for lib in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(lib).cudaGetLastError()
            return
        except OSError:
            continue


def p_n9(dev: torch.device) -> None:
    """A registered host buffer dropped without release (an Engine dropped without
    close()), then a new host_buffer at the reused address: REPRODUCED when registering it
    fails (the dropped one was never unregistered), FIXED when it works."""
    from zerotrain.memory.host import host_buffer, release_host_buffer

    name = "N9: host buffer freed without release, address reused by a new one"
    if dev.type != "cuda":
        row(name, "SKIP", "needs the CUDA runtime (cudaHostRegister); no CPU stand-in")
        return
    # 40 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so every such block
    # is its own mapping and a freed one's address comes back for the next (a smaller
    # block would move to the heap after the first free and never reuse the address)
    n = 10 << 20
    t = host_buffer(n, torch.float32, True)
    ptr = t.data_ptr()
    del t
    try:
        for _ in range(8):
            try:
                u = host_buffer(n, torch.float32, True)
            except Exception as e:
                _clear_last_cuda_error()
                row(name, "REPRODUCED", f"host_buffer at a reused address: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:140]}")
                return
            same = u.data_ptr() == ptr
            release_host_buffer(u)
            if same:
                row(name, "FIXED", "a new registered buffer at the freed address works")
                return
        row(name, "SKIP", "inconclusive: the allocator did not reuse the address")
    finally:  # a leftover registration must not leak into later sections
        torch.cuda.cudart().cudaHostUnregister(ptr)
        _clear_last_cuda_error()


# ----------------------------------------------------------------------------- main

# (probe, every rank takes part): rank-local probes run on rank 0 only
PROBES: list[tuple[str, Callable[[torch.device], None], bool]] = [
    ("C1", p_c1, True), ("H1", p_h1, True), ("S3", p_s3, False), ("FP8", p_fp8, False),
    ("FP8 recipes", p_fp8_recipes, False), ("N1", p_n1, False), ("C2", p_c2, True),
    ("N2", p_n2, False), ("N9", p_n9, False),  # N2, N9 last: they touch CUDA error paths
]


def main() -> None:
    global DRY
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--only", nargs="*", help="probe names (default: all)")
    args = p.parse_args()
    DRY = args.dry_run
    from zerotrain.comm.dist import init_distributed

    info = init_distributed("cpu" if DRY else "cuda", "auto", 60)
    rank = info.rank
    for name, fn, everyone in PROBES:
        if args.only and name not in args.only:
            continue
        if everyone or rank == 0:
            guarded(name, fn, info.device)
    if rank == 0:
        Path(args.out, "probes.json").write_text(json.dumps(
            {"backend": info.backend, "world": info.world_size, "device": str(info.device),
             "rows": ROWS}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
