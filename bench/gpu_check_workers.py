"""The jobs of bench/gpu_check.py, each started by torchrun on the GPUs (or, with
--dry-run, on CPU ranks over gloo, to test this script where there is no GPU).

    python -m torch.distributed.run --standalone --nproc-per-node N \
        bench/gpu_check_workers.py stages --out DIR [--dry-run]
    ... perf --system zt-3|zt-2|fsdp2|fsdp2-noreshard --preset llama-1b --out DIR

stages: every ZeRO stage and Offload, fp32 (TF32 off) and bf16, a few steps of a small
        GPT on a fixed global batch; rank 0 saves each run's final full parameters and
        losses (`stages.pt`; `stages_ref.pt` for the one-process stage-0 reference), so
        the driver can hold them against one process. At N >= 2 also N1 and W-1 end to
        end (ZeRO-3 with the FP8 all-gather, 32 steps against plain FP8 bit for bit:
        REPRODUCED / FIXED). --dry-run: fewer cases.
perf:   one system on a 1-3B model built on the meta device (zerotrain's engine
        materialises it; FSDP2 gets to_empty + the model's init_param): step time, peak and
        after-init torch.cuda.max_memory_allocated.
Rank 0 writes `<job>.json`; a failure is written there too, with its traceback.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.comm.dist import init_distributed
from zerotrain.config import build_config, deep_merge
from zerotrain.data.sampler import local_rows

STAGES: list[tuple[str, dict]] = [
    ("stage 0", {"zero": {"stage": 0}}),
    ("stage 1", {"zero": {"stage": 1}}),
    ("stage 2", {"zero": {"stage": 2}}),
    ("stage 3", {"zero": {"stage": 3}}),
    ("stage 2 + offload", {"zero": {"stage": 2, "offload_optimizer": "cpu"}}),
    ("stage 3 + offload", {"zero": {"stage": 3, "offload_optimizer": "cpu"}}),
]
RING = ("stage 2, ring", {"zero": {"stage": 2}, "comm": {"algorithm": "ring"}})
SEQ, PER_RANK = 32, 4  # the global batch is PER_RANK rows per rank of the sharded run


def small_config(overrides: dict, world: int, rows: int, steps: int, device: str) -> Any:
    base = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": SEQ,
                      "bias": False},
            # a small lr: Adam turns a rounding-level change of a near-zero gradient
            # into a full ±lr step, which at large lr swamps the comparison in bf16
            "optimizer": {"lr": 2e-3, "grad_clip": 0.5},
            "schedule": {"warmup_steps": 0, "kind": "constant"},
            "zero": {"bucket_mb": 0.05},
            "comm": {"algorithm": "native", "check_lockstep": True, "timeout_s": 120},
            "data": {"micro_batch_size": rows // world},
            "train": {"steps": steps, "device": device}}
    return build_config(deep_merge(base, overrides))


def batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    pool = [(torch.randint(0, 256, (global_batch, SEQ), generator=g),
             torch.randint(0, 256, (global_batch, SEQ), generator=g)) for _ in range(2)]
    return [pool[i % 2] for i in range(steps)]


def train_small(overrides: dict, steps: int, device: str, rows: int) -> dict:
    """One configuration, every rank its slice of the same `rows`-row global batches."""
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    cfg = small_config(overrides, world, rows, steps, device)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg)
    b = cfg.data.micro_batch_size
    losses = []
    if eng.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for X, Y in batches(steps, rows):
        rows = local_rows(0, rank, world, b)
        loss = eng(X[rows].to(eng.device), Y[rows].to(eng.device))
        eng.backward(loss)
        eng.step()
        losses.append(float(eng.comm.all_reduce_scalars(loss.detach().reshape(1))[0]) / world)
    with eng.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in eng.module.named_parameters()}
    s = eng.strategy
    facts = {"comm_device": str(eng.comm.device), "backend": eng.comm.backend,
             "strategy": s.name, "comm_thread": eng.comm._thread is not None}
    if s.offload and eng.device.type == "cuda":
        facts["host_states_pinned"] = all(u.master.is_pinned() for u in s.units)
    if eng.device.type == "cuda":
        facts["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    eng.close()
    return {"losses": losses, "params": params, "facts": facts}


N1_CASE = ("stage 3 + fp8 all-gather (N1; W-1: 32 steps vs plain FP8)",
           {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2},
            "precision": {"dtype": "bf16", "fp8": {"enabled": True, "recipe": "tensorwise"}}})


def job_stages(args: argparse.Namespace) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    info = init_distributed(device, "auto", 120)
    runs = STAGES + ([RING] if info.world_size > 1 else [])
    precisions = ("fp32", "bf16")
    if args.dry_run:  # the script's test: a few of each kind
        runs, precisions = [STAGES[3]], ("fp32",)
    if args.reference:  # one process: stage 0 is the reference for every row
        runs = STAGES[:1]
    out: dict = {}
    for prec in precisions:
        for name, over in runs:
            over = deep_merge(over, {"precision": {"dtype": prec, "tf32": False}})
            t0 = time.perf_counter()
            res = train_small(over, args.steps, device, PER_RANK * args.batch_world)
            res["seconds"] = time.perf_counter() - t0
            out[f"{name} | {prec}"] = res
    if info.world_size > 1:
        out[N1_CASE[0]] = n1_end_to_end(args, device)
    if info.rank == 0:
        name = "stages_ref.pt" if args.reference else "stages.pt"
        torch.save(out, Path(args.out) / name)
    return {"world_size": info.world_size, "runs": list(out)}


def n1_end_to_end(args: argparse.Namespace, device: str) -> dict:
    """N1 and W-1 at N ranks. N1: ZeRO-3 with the FP8 all-gather died at init with
    torch.stack mixing devices. W-1: a rank refreshed the scale of a weight it holds no
    piece of only once, so the gathered weights drift from plain FP8 after the first
    power-of-two change of its amax. Tensorwise power-of-two scales make the two runs
    equal bit for bit when correct: 32 steps at full learning rate (8 in the dry run,
    where CPU ranks show W-1 as well)."""
    steps, rows = (8 if args.dry_run else 32), PER_RANK * args.batch_world
    wired = deep_merge(N1_CASE[1], {"precision": {"fp8": {"all_gather": True}}})
    try:
        got = train_small(wired, steps, device, rows)
    except Exception as e:
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        mixed = "device" in text and ("stack" in traceback.format_exc()
                                      or "same device" in text)
        return {"status": "REPRODUCED" if mixed else "FAIL", "error": f"N1: {text}"}
    want = train_small(N1_CASE[1], steps, device, rows)
    diff = max(float((got["params"][k] - v).abs().max()) for k, v in want["params"].items())
    first = next((i + 1 for i, (a, b) in enumerate(zip(got["losses"], want["losses"]))
                  if a != b), None)
    same = diff == 0 and first is None
    return {"status": "FIXED" if same else "REPRODUCED",
            "error": f"N1 fixed (built and trained at N={dist.get_world_size()}); W-1 "
                     f"{'fixed' if same else 'reproduced'}: {steps} steps with the FP8 "
                     f"all-gather vs plain FP8, first differing loss at step {first}, max "
                     f"|param diff| {diff:.3g} (bitwise expected)"}


# ----------------------------------------------------------------------------- perf


def meta_model(preset: str, seq: int, vocab: int) -> torch.nn.Module:
    """The perf model on the meta device, as `zerotrain train` builds it: no system pays
    for a whole fp32 model on the GPU at init (review 3, section 6, item 4)."""
    from zerotrain.config import ModelConfig
    from zerotrain.models import build_model

    return build_model(ModelConfig(preset=preset, block_size=seq, vocab_size=vocab),
                       device="meta")


def job_perf(args: argparse.Namespace) -> dict:
    dev_kind = "cpu" if args.dry_run else "cuda"
    info = init_distributed(dev_kind, "auto", 600)
    dev = info.device
    rank, world = info.rank, info.world_size
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step, params = (_zerotrain if args.system.startswith("zt") else _fsdp2)(args, dev)
    init_s = time.perf_counter() - t0
    init_peak = torch.cuda.max_memory_allocated() if cuda else 0
    g = torch.Generator().manual_seed(7)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(step(x.to(dev), y.to(dev)))
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    t = torch.tensor([max(times) if times else 0.0, sorted(times)[len(times) // 2]],
                     dtype=torch.float64, device=dev if cuda else "cpu")
    peak = torch.tensor([float(torch.cuda.max_memory_allocated() if cuda else 0)],
                        device=t.device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"system": args.system, "world_size": world, "params": params,
            "median_step_s": float(t[1]), "tokens_per_s": args.batch * args.seq * world
            / float(t[1]) if float(t[1]) else 0.0, "peak_gib": float(peak[0]) / 2**30,
            "init_peak_gib": init_peak / 2**30, "init_s": init_s, "losses": losses,
            "rank": rank}


def _zerotrain(args: argparse.Namespace, dev: torch.device):
    """zerotrain's engine, bf16 with FP32 masters, AdamW (compile: auto, the default)."""
    from zerotrain.engine import Engine

    stage = int(args.system.split("-")[1])
    model = meta_model(args.preset, args.seq, args.vocab)  # the engine materialises it
    cfg = build_config({"model": {"preset": args.preset, "block_size": args.seq,
                                  "vocab_size": args.vocab},
                        "precision": {"dtype": "bf16"},
                        "zero": {"stage": stage, "bucket_mb": 100},
                        "optimizer": {"lr": 1e-4, "grad_clip": 1.0},
                        "schedule": {"warmup_steps": 0, "kind": "constant"},
                        "comm": {"timeout_s": 600},
                        "train": {"steps": 100, "device": dev.type}})
    eng = Engine(model, cfg, dev)

    def step(x, y) -> float:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        return float(loss)

    return step, sum(p.numel() for p in model.parameters())


def _fsdp2(args: argparse.Namespace, dev: torch.device):
    """FSDP2 (fully_shard per block and at the root), bf16 compute with fp32 parameters
    and reductions, torch's fused AdamW; `fsdp2` reshards after forward (ZeRO-3-like),
    `fsdp2-noreshard` keeps parameters gathered (ZeRO-2-like)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = meta_model(args.preset, args.seq, args.vocab)
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = args.system == "fsdp2"
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    # meta -> this rank's shards, then the model's own values (init_param: from the seed
    # and the name, as zerotrain draws them), one whole parameter at a time
    model.to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype, device=dev)
            model.init_param(name, full)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            del full
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")

    def step(x, y) -> float:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["stages", "perf"])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--batch-world", type=int, default=1, help="stages: the sharded run's N")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--system", default="zt-3", help="perf: one, or several joined by ','")
    p.add_argument("--vocab", type=int, default=32000, help="perf: vocabulary size")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    # perf: several systems one after another in one process (the dry run's economy)
    for system in args.system.split(",") if args.job == "perf" else [args.system]:
        args.system = system
        name = args.job + ("_ref" if args.reference else "") + (
            f"_{system}" if args.job == "perf" else "")
        result: dict
        try:
            result = {"ok": True,
                      **(job_stages(args) if args.job == "stages" else job_perf(args))}
        except BaseException as e:  # reported by the driver, never a silent hang
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 or not result["ok"]:
            suffix = "" if result["ok"] else f"_rank{rank}_failed"
            (Path(args.out) / f"{name}{suffix}.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
