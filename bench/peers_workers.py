"""One training job of bench/peers.py: one system, N ranks, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/peers_workers.py --system zt-2 --data bench/results/peers_data.pt --out r.json

Every system gets the same model (zerotrain's GPT built under the same seed), the same
per-rank slices of the same global batches, AdamW with the same hyper-parameters and
parameter groups (decay on matrices and embeddings, none on biases and norm gains), a
constant learning rate and no gradient clipping. What differs is only who keeps which
model state and how gradients and parameters travel.

Rank 0 writes one JSON object to --out: per-step wall times (max over ranks), losses,
peak RSS of every rank, bytes on the loopback interface, and the bytes the system says
it sent (zerotrain only). A failure is written there too, with its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerotrain.config import ModelConfig
from zerotrain.memory import proc_status
from zerotrain.models.gpt import GPT

# ---------------------------------------------------------------------------- systems
# name -> (family, options). zerotrain names: zt-<stage>[-off][-ring][-bf16].
ZT_SYSTEMS = [
    "zt-0", "zt-1", "zt-2", "zt-3", "zt-2-off", "zt-3-off",
    "zt-0-ring", "zt-1-ring", "zt-2-ring", "zt-3-ring", "zt-2-off-ring", "zt-3-off-ring",
    "zt-0-auto", "zt-1-auto", "zt-2-auto", "zt-3-auto", "zt-2-off-auto", "zt-3-off-auto",
    "zt-2-bf16", "zt-3-bf16", "zt-3-off-bf16",
]
TORCH_SYSTEMS = [
    "ddp", "ddp-zero", "fsdp2", "fsdp2-reshard", "fsdp2-offload",
    "fsdp2-bf16", "fsdp2-reshard-bf16", "fsdp2-offload-bf16",
]
DS_SYSTEMS = ["ds-0", "ds-1", "ds-2", "ds-3"]
# Not in the default set: DeepSpeed's own CPU Adam offload, and ZeRO-3 with its default
# reuse distance (a gathered block stays until its backward: ZeRO-3 memory in forward
# only, ZeRO-2 traffic).
EXTRA_SYSTEMS = ["ds-2-off", "ds-3-off", "ds-3-reuse"]
ALL_SYSTEMS = ZT_SYSTEMS + TORCH_SYSTEMS + DS_SYSTEMS + EXTRA_SYSTEMS


def describe(system: str) -> dict[str, Any]:
    """Family, memory class and precision of a system name (also used by peers.py)."""
    parts = system.split("-")
    bf16 = "bf16" in parts
    if parts[0] == "zt":
        stage = int(parts[1])
        off = "off" in parts
        mem = "offload" if off else {0: "stage0/1", 1: "stage0/1"}.get(stage, f"stage{stage}")
        algo = next((a for a in ("ring", "auto") if a in parts), "native")
        label = f"zerotrain ZeRO-{stage}" if stage else "zerotrain DDP (stage 0)"
        if off:
            label = f"zerotrain ZeRO-{stage}-Offload"
        return dict(family="zerotrain", memory_class=mem, precision="bf16" if bf16 else "fp32",
                    label=f"{label} {algo}" + (" bf16" if bf16 else ""), stage=stage,
                    offload=off, algorithm=algo)
    if parts[0] == "ds":
        stage = int(parts[1])
        off = "off" in parts
        mem = "offload" if off else {0: "stage0/1", 1: "stage0/1"}.get(stage, f"stage{stage}")
        label = f"DeepSpeed ZeRO-{stage}" + ("-Offload (DeepSpeedCPUAdam)" if off else "")
        reuse = "reuse" in parts
        if reuse:
            label += " (default reuse distance: no re-gather in backward)"
        return dict(family="deepspeed", memory_class=mem, precision="fp32", label=label,
                    stage=stage, offload=off, reuse=reuse)
    table = {
        "ddp": ("stage0/1", "PyTorch DDP"),
        "ddp-zero": ("stage0/1", "DDP + ZeroRedundancyOptimizer"),
        "fsdp2": ("stage2", "FSDP2 reshard_after_forward=False"),
        "fsdp2-reshard": ("stage3", "FSDP2 reshard_after_forward=True"),
        "fsdp2-offload": ("offload", "FSDP2 CPUOffloadPolicy (reshard=True)"),
    }
    base = system.removesuffix("-bf16")
    mem, label = table[base]
    return dict(family="torch", memory_class=mem, precision="bf16" if bf16 else "fp32",
                label=label + (" bf16" if bf16 else ""))


# ---------------------------------------------------------------------------- helpers
def loopback_tx_bytes() -> int | None:
    """Bytes sent on `lo` in this network namespace, or None without /proc/net/dev."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def decay_groups(params: list[Tensor], wd: float) -> list[dict]:
    """zerotrain's default grouping: decay tensors with ndim >= 2, not biases/norm gains."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def adamw_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    if a.peer_adamw == "fused":
        kw["fused"] = True
    elif a.peer_adamw == "foreach":
        kw["foreach"] = True
    elif a.peer_adamw == "loop":
        kw["foreach"] = False
    return kw


COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
               "all_to_all_single", "reduce", "all_reduce_coalesced", "isend", "irecv", "send",
               "recv", "barrier")


class CallCounter:
    """Counts Python-level torch.distributed calls and their payload per op (diagnostic).

    Wraps the module functions, so it sees what a system calls through
    `torch.distributed.X` at run time — not DDP's C++ reducer, nor code that bound a
    function before the wrap. Payload = bytes of the tensor arguments handed in.
    """

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.on = False
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                nbytes = 0
                for t in [*args, *kwargs.values()]:
                    if isinstance(t, Tensor):
                        nbytes = max(nbytes, t.numel() * t.element_size())
                    elif isinstance(t, list | tuple):
                        nbytes = max(nbytes, sum(x.numel() * x.element_size()
                                                 for x in t if isinstance(x, Tensor)))
                c = self.calls.setdefault(name, [0, 0])
                c[0] += 1
                c[1] += nbytes
            return fn(*args, **kwargs)
        return wrapped


@dataclass
class Job:
    """What one system hands the loop: a train step, an eval forward, and its notes."""

    train_step: Callable[[Tensor, Tensor], Tensor]
    eval_loss: Callable[[Tensor, Tensor], Tensor]
    traffic: Callable[[], int | None] = lambda: None  # bytes this rank says it sent
    traffic_how: str = "n/a"
    notes: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    engine: Any = None  # the system's own engine object, for callers that inspect it


def engine_job(eng: Any, **job: Any) -> Job:
    """A loop over an engine with the `engine(x, y)` / `.backward(loss)` / `.step()` API,
    which zerotrain and DeepSpeed share."""

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        return loss.detach()

    def evaluate(x: Tensor, y: Tensor) -> Tensor:
        return eng(x, y).detach()

    return Job(step, evaluate, engine=eng, **job)


# ---------------------------------------------------------------------------- zerotrain
def zerotrain_job(a: argparse.Namespace, model: nn.Module, system: str) -> Job:
    from zerotrain.config import build_config, deep_merge
    from zerotrain.engine import Engine

    d = describe(system)
    cfg_dict: dict[str, Any] = {
        "model": json.loads(a.model),
        "data": {"micro_batch_size": a.micro_batch},
        "optimizer": {"name": "adamw", "lr": a.lr, "weight_decay": a.weight_decay,
                      "betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": None},
        "schedule": {"kind": "constant", "warmup_steps": 0, "min_lr": 0.0},
        "precision": {"dtype": d["precision"]},
        "zero": {"stage": d["stage"], "offload_optimizer": "cpu" if d["offload"] else "none"},
        "comm": {"algorithm": d["algorithm"], "backend": "gloo"},
        "train": {"steps": a.steps + a.warmup + 1, "device": "cpu", "seed": a.seed},
    }
    cfg_dict = deep_merge(cfg_dict, json.loads(a.zt_config)) if a.zt_config else cfg_dict
    cfg = build_config(cfg_dict)
    eng = Engine(model, cfg, torch.device("cpu"))
    how = {"ring": "observed", "native": "computed"}.get(d["algorithm"], "observed+computed")
    z = cfg.zero
    notes = {"bucket_mb": z.bucket_mb, "overlap": z.overlap, "prefetch": z.prefetch,
             "strategy": eng.strategy.name, "units": len(eng.strategy.units)}
    return engine_job(eng, traffic=lambda: int(eng.last_traffic_bytes[0]),
                      traffic_how=f"zerotrain {how}", notes=notes, close=eng.close)


# ---------------------------------------------------------------------------- PyTorch
def torch_job(train_model: nn.Module, model: nn.Module, opt: torch.optim.Optimizer,
              notes: dict[str, Any]) -> Job:
    """A plain PyTorch loop: forward through the wrapper, backward, step, zero."""

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = train_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def evaluate(x: Tensor, y: Tensor) -> Tensor:
        return model(x, y).detach()

    return Job(step, evaluate, notes=notes)


def ddp_job(a: argparse.Namespace, model: nn.Module, system: str) -> Job:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    params = list(model.parameters())
    if system == "ddp-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            decay_groups(params, a.weight_decay), optimizer_class=torch.optim.AdamW,
            **adamw_kwargs(a))
    else:
        opt = torch.optim.AdamW(decay_groups(params, a.weight_decay), **adamw_kwargs(a))

    return torch_job(ddp, model, opt, {"adamw": a.peer_adamw})


def fsdp2_job(a: argparse.Namespace, model: nn.Module, system: str) -> Job:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = "reshard" in system or "offload" in system
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if system.endswith("-bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if "offload" in system:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(decay_groups(list(model.parameters()), a.weight_decay),
                            **adamw_kwargs(a))

    return torch_job(model, model, opt, {"adamw": a.peer_adamw, "reshard": reshard})


# ---------------------------------------------------------------------------- DeepSpeed
def deepspeed_job(a: argparse.Namespace, model: nn.Module, system: str) -> Job:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    d = describe(system)
    deepspeed.init_distributed(dist_backend="gloo")
    zero: dict[str, Any] = {"stage": d["stage"]}
    if d["stage"] > 0:
        mb = int(a.ds_bucket_mb * 2**20 / 4)  # DeepSpeed counts bucket sizes in elements
        zero.update(reduce_bucket_size=mb, allgather_bucket_size=mb, overlap_comm=False)
    if d["stage"] == 3:
        # As zerotrain and FSDP2-reshard do: gather each block again in backward. DeepSpeed's
        # default reuse distance (1e9) keeps gathered blocks until their backward instead:
        # system "ds-3-reuse" measures that.
        reuse = 10**9 if d["reuse"] else 0
        zero.update(stage3_prefetch_bucket_size=mb, stage3_param_persistence_threshold=0,
                    stage3_max_reuse_distance=reuse)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": a.micro_batch * dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    groups = decay_groups(list(model.parameters()), a.weight_decay)
    if d["offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": a.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": a.weight_decay}}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                                 config=config)
    else:
        client = torch.optim.AdamW(groups, **adamw_kwargs(a))
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)

    notes = {"deepspeed": deepspeed.__version__, "optimizer": type(opt).__name__,
             "adamw": "DeepSpeedCPUAdam" if d["offload"] else a.peer_adamw,
             "bucket_elements": zero.get("reduce_bucket_size")}
    return engine_job(engine, notes=notes)


def build_job(a: argparse.Namespace, model: nn.Module) -> Job:
    fam = describe(a.system)["family"]
    if fam == "zerotrain":
        return zerotrain_job(a, model, a.system)
    if fam == "deepspeed":
        return deepspeed_job(a, model, a.system)
    if a.system.startswith("ddp"):
        return ddp_job(a, model, a.system)
    return fsdp2_job(a, model, a.system)


# ---------------------------------------------------------------------------- the loop
def run(a: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(a.threads)
    data = torch.load(a.data)
    X, Y = data["x"], data["y"]  # (steps + 1, global_batch, T); the last one is held out
    need = a.warmup + a.steps + 1
    if X.shape[0] < need or X.shape[1] != a.micro_batch * world:
        raise ValueError(f"data holds {tuple(X.shape)}, need {need} batches of "
                         f"{a.micro_batch * world} sequences")
    lo, hi = rank * a.micro_batch, (rank + 1) * a.micro_batch
    counter = CallCounter() if a.count_calls else None
    base_rss = proc_status()["VmRSS"]
    torch.manual_seed(a.seed)  # the same initial weights in every system and on every rank
    model = GPT(ModelConfig(**json.loads(a.model)))
    job = build_job(a, model)
    times, losses, traffic = [], [], []
    lo_start = lo_end = None
    profiler = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            dist.barrier()
            lo_start = loopback_tx_bytes()
            if counter is not None:
                counter.on = True
            if a.profile and rank == 0:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
        x, y = X[i, lo:hi], Y[i, lo:hi]
        t0 = time.perf_counter()
        loss = job.train_step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        traffic.append(job.traffic())
    if counter is not None:
        counter.on = False
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        with open(a.out + ".profile.txt", "w") as f:
            f.write(table)
    dist.barrier()
    lo_end = loopback_tx_bytes()
    with torch.no_grad():
        final = job.eval_loss(X[-1, lo:hi], Y[-1, lo:hi]).double()
    peak = proc_status()["VmHWM"]
    job.close()

    # Gather: step time = slowest rank's time of that step; losses averaged over ranks.
    per_rank = torch.tensor([[*times, float(peak), float(base_rss)]], dtype=torch.float64)
    every = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(every, per_rank)
    stacked = torch.cat(every)
    n = len(times)
    step_times = stacked[:, :n].max(dim=0).values.tolist()
    loss_t = torch.stack([t.double() for t in losses] + [final])
    dist.all_reduce(loss_t)
    loss_t /= world
    sent = [t for t in traffic[a.warmup:] if t is not None]
    lo_bytes = (None if lo_start is None or lo_end is None
                else (lo_end - lo_start) / (world * a.steps))
    return {
        "system": a.system, **describe(a.system), "ok": True, "world_size": world,
        "threads": torch.get_num_threads(), "warmup": a.warmup, "steps": a.steps,
        "step_times_s": step_times[a.warmup:], "warmup_times_s": step_times[:a.warmup],
        "losses": loss_t[:-1].tolist(), "final_loss": float(loss_t[-1]),
        "peak_rss_bytes": stacked[:, n].tolist(), "base_rss_bytes": stacked[:, n + 1].tolist(),
        "sent_bytes_per_step": (sum(sent) / len(sent)) if sent else None,
        "sent_how": job.traffic_how, "loopback_bytes_per_rank_step": lo_bytes,
        "notes": job.notes, "torch": torch.__version__,
        "dist_calls_per_step": None if counter is None else {
            k: {"calls": c / a.steps, "payload_bytes": b / a.steps}
            for k, (c, b) in sorted(counter.calls.items())},
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=ALL_SYSTEMS)
    p.add_argument("--data", required=True, help="tensor file written by peers.py")
    p.add_argument("--out", required=True, help="JSON result path (rank 0 writes it)")
    p.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--peer-adamw", choices=["default", "loop", "foreach", "fused"],
                   default="fused", help="torch.optim.AdamW implementation for the peers")
    p.add_argument("--zt-config", default="", help="JSON merged into zerotrain's config")
    p.add_argument("--ds-bucket-mb", type=float, default=25.0)
    p.add_argument("--profile", action="store_true", help="torch.profiler table on rank 0")
    p.add_argument("--count-calls", action="store_true",
                   help="count Python-level torch.distributed calls per step (diagnostic)")
    return p.parse_args(argv)


def run_rank(a: argparse.Namespace, work: Callable[[], dict[str, Any]],
             timeout_s: int) -> None:
    """One rank of a benchmark job: `work()` inside a gloo group; rank 0 writes its result
    to `a.out`, a failing rank its error and traceback to `a.out`.rank<r>.err (recorded in
    the table, not hidden) before re-raising."""
    rank = int(os.environ.get("RANK", 0))
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        result = work()
    except BaseException as e:
        err = {"system": a.system, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
        with open(f"{a.out}.rank{rank}.err", "w") as f:
            json.dump(err, f)
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)


def main() -> None:
    a = parse()
    run_rank(a, lambda: run(a), 300)


if __name__ == "__main__":
    main()
