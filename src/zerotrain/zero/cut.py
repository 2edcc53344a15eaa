"""How parameters become units, and the shape of the run that cut makes: one place.

Two rules, each named by the strategy that uses it (`Strategy.cut`): stages 0-2 cut
size-bounded buckets in reverse registration order (gradient readiness order); ZeRO-3
cuts the plan's blocks plus a root unit for everything else (`models.plan.unit_members`,
the plan's own answer to "which block owns which parameter"). The engine's strategy and
`zerotrain estimate` both cut through here, and `run_shape` turns the cut into the
numbers the memory formulas read (`memory.RunShape`) without a live tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.config import Config, ZeroConfig
from zerotrain.memory import (
    COMPILE_RUNTIME_BYTES,
    CPU_RETENTION,
    BytesPerParam,
    RunShape,
    declared_offloads,
    shard_numel,
)
from zerotrain.models.plan import Plan, unit_members
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim import resolve_compile, state_bytes_per_param
from zerotrain.zero.flat import NamedParams, flat_end

#: (unit name, its parameters, extra Unit fields)
UnitSpec = tuple[str, NamedParams, dict]


def trainable(model: nn.Module, plan: Plan) -> NamedParams:
    """(name, parameter, optimizer group) of every trainable parameter, in model order."""
    return [(n, p, int(plan.group_of(n))) for n, p in model.named_parameters()
            if p.requires_grad]


def bucket_params(named: NamedParams, bucket_numel: int) -> list[NamedParams]:
    """Cut parameters into buckets in reverse registration order (≈ the order their
    gradients become ready in backward), each at most `bucket_numel` unless one
    parameter alone is larger."""
    buckets: list[NamedParams] = [[]]
    size = 0
    for item in reversed(named):
        n = item[1].numel()
        if buckets[-1] and size + n > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return [b for b in buckets if b]


def buckets(named: NamedParams, cfg: ZeroConfig, policy: PrecisionPolicy) -> list[UnitSpec]:
    """Stages 0-2: buckets of `zero.bucket_mb` in the reduce dtype."""
    numel = max(1, int(cfg.bucket_mb * 2**20 / policy.reduce_dtype.itemsize))
    return [(f"bucket{i}", b, {}) for i, b in enumerate(bucket_params(named, numel))]


def blocks(model: nn.Module, plan: Plan, named: NamedParams) -> list[UnitSpec]:
    """ZeRO-3: the plan's blocks, plus a root unit for everything else."""
    return [(name, ps, {"module": m}) for name, ps, m in unit_members(model, plan, named)]


def align_for(device_type: str, policy: PrecisionPolicy) -> int:
    """GPUs want 16-byte aligned parameters and shards; the CPU packs them end to end."""
    return 16 // policy.param_dtype.itemsize if device_type == "cuda" else 1


def run_shape(cls, cfg: Config, model: nn.Module, plan: Plan, device_type: str,
              world: int) -> RunShape:
    """The shape of a run of strategy class `cls` (its declarations and its cut) over
    `model` (a meta model does: only shapes are read) at `world` ranks."""
    policy = PrecisionPolicy.from_config(cfg.precision)
    named = trainable(model, plan)
    align = align_for(device_type, policy)
    numels = tuple(flat_end(ps, align) for _, ps, _ in cls.cut(model, plan, named, cfg.zero,
                                                                policy))
    sharded = "optimizer" in cls.shards
    own = sum(shard_numel(n, world) for n in numels) if sharded else sum(numels)
    compiled = cfg.optimizer.name in ("adam", "adamw") and resolve_compile(
        cfg.optimizer.compile, [{"params": [torch.empty(own, device="meta")]}])
    k = state_bytes_per_param(cfg.optimizer.name, cfg.optimizer.momentum)
    bpp = BytesPerParam(policy.param_dtype.itemsize, policy.grad_dtype.itemsize,
                        policy.master_dtype.itemsize if policy.master_dtype else 0, k)
    widest = max(p.numel() for _, p, _ in named)
    cpu = device_type == "cpu"
    # the tiers the config asks for (zero.offload_param / offload_optimizer, issue 25)
    offloads, disk = declared_offloads(cfg.zero.offload_optimizer, cfg.zero.offload_param)
    return RunShape(
        numels, world, bpp, cls.shards, cls.offloads | offloads, disk,
        offload_prefetch=cfg.zero.offload_prefetch, micro_steps=cfg.data.grad_accum_steps,
        largest_unit=max(numels),
        widest_param=widest, reduce_bytes=policy.reduce_dtype.itemsize,
        in_flight=cfg.zero.in_flight(device_type), prefetch=cfg.zero.prefetch,
        high_water=cpu, lazy_grads=cpu,
        init_piece=widest if plan.init is not None else None,
        runtime=COMPILE_RUNTIME_BYTES if compiled else 0,
        retention=CPU_RETENTION if cpu else 0.0, stage=cls.stage)
