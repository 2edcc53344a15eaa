"""How parameters become units, and the shape of the run that cut makes: one place.

Two rules, each named by the strategy that uses it (`Strategy.cut`): stages 0-2 cut
size-bounded buckets in reverse registration order (gradient readiness order); ZeRO-3
cuts the plan's blocks plus a root unit for everything else (`unit_members`: which block
owns which parameter, read from the plan's blocks; `unit_numels` / `model_size` count
that cut on a meta model for the estimator). The engine's strategy and
`zerotrain estimate` both cut through here, and `run_shape` turns the cut into the
numbers the memory formulas read (`memory.RunShape`) without a live tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain.config import Config, ModelConfig, ZeroConfig
from zerotrain.memory import (
    COMPILE_RUNTIME_BYTES,
    CPU_RETENTION,
    BytesPerParam,
    RunShape,
    declared_offloads,
    shard_numel,
)
from zerotrain.models import build_model, count_params, on_meta, plan_for
from zerotrain.models.plan import Plan
from zerotrain.numerics.blockquant import BLOCK
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim import resolve_compile, state_bytes_per_param
from zerotrain.zero.flat import NamedParams, flat_end
from zerotrain.zero.params.wire import PlainWire, choose_wire
from zerotrain.zero.states.disk import io_bytes

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


def unit_members(model: nn.Module, plan: Plan, named: list[tuple]
                 ) -> list[tuple[str, list[tuple], nn.Module]]:
    """ZeRO-3's units: (name, its entries of `named`, the module whose hooks drive it).

    `named` holds (name, parameter, ...) tuples. Blocks claim their parameters first, in
    order (a weight tied between a block and the rest belongs to the block); whatever is
    left forms the root unit, driven by the model itself and listed first.
    """
    taken: set[int] = set()
    blocks = []
    for i, m in enumerate(plan.blocks):
        ids = {id(p) for p in m.parameters()}
        mine = [t for t in named if id(t[1]) in ids and id(t[1]) not in taken]
        taken |= {id(t[1]) for t in mine}
        if mine:
            blocks.append((f"block{i}", mine, m))
    root = [t for t in named if id(t[1]) not in taken]
    return ([("root", root, model)] if root else []) + blocks


def unit_numels(model_or_factory: nn.Module | Callable[[], nn.Module]) -> dict[str, int]:
    """Elements per ZeRO-3 unit, by the very rule ZeRO-3 cuts with (`unit_members`).

    ZeRO-3 materialises one unit at a time, so the largest sets the transient memory.
    """
    model = on_meta(model_or_factory)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {name: sum(t[1].numel() for t in ps)
            for name, ps, _ in unit_members(model, plan_for(model), named)}


def model_size(model_cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, largest ZeRO-3 unit) of the model a config describes."""
    model = build_model(model_cfg, device="meta")
    return count_params(model), max(unit_numels(model).values(), default=0)


def align_for(device_type: str, policy: PrecisionPolicy) -> int:
    """GPUs want 16-byte aligned parameters and shards; the CPU packs them end to end.
    int8 optimizer states: every parameter and shard starts a quantisation block, so no
    block straddles a shard and every world size and stage quantises the same blocks."""
    if policy.state_dtype == "int8":
        return BLOCK
    return 16 // policy.param_dtype.itemsize if device_type == "cuda" else 1


#: the eager elementwise rules make one fp32 transient per element they update (Adam's
#: denominator √v, Lion's sign, SGD's decayed gradient: optim/functional.py)
UPDATE_TEMP_BYTES = 4


def run_shape(cls, cfg: Config, model: nn.Module, plan: Plan, device_type: str,
              world: int) -> RunShape:
    """The shape of a run of strategy kind `cls` (`zero.placement.Kind`: its stage's
    declarations and cut, its placement's `offloads`) over
    `model` (a meta model does: only shapes are read) at `world` ranks."""
    policy = PrecisionPolicy.from_config(cfg.precision, cfg.optimizer)
    named = trainable(model, plan)
    align = align_for(device_type, policy)
    cut = [ps for _, ps, _ in cls.cut(model, plan, named, cfg.zero, policy)]
    numels = tuple(flat_end(ps, align) for ps in cut)
    wire = choose_wire(cls.shards, plan, cfg.zero, fp8_gather=cfg.precision.fp8.all_gather)
    pb = policy.param_dtype.itemsize
    gather = (() if type(wire) is PlainWire
              else tuple(wire.unit_bytes(ps, n, pb) for ps, n in zip(cut, numels, strict=True)))
    sharded = "optimizer" in cls.shards
    own = sum(shard_numel(n, world) for n in numels) if sharded else sum(numels)
    compiled = cfg.optimizer.name in ("adam", "adamw") and resolve_compile(
        cfg.optimizer.compile, [{"params": [torch.empty(own, device="meta")]}])
    k = state_bytes_per_param(cfg.optimizer.name, cfg.optimizer.momentum,
                              policy.stored_state_dtype)
    bpp = BytesPerParam(policy.param_dtype.itemsize, policy.grad_dtype.itemsize,
                        policy.master_dtype.itemsize if policy.master_dtype else 0, k,
                        comp=2 if policy.master_update == "kahan" else 0)
    widest = max(p.numel() for _, p, _ in named)
    cpu = device_type == "cpu"
    # the tiers the config asks for (zero.offload_param / offload_optimizer, issue 25)
    offloads, disk = declared_offloads(cfg.zero.offload_optimizer, cfg.zero.offload_param,
                                       host_is_device=cpu)
    return RunShape(
        numels, world, bpp, cls.shards, cls.offloads | offloads, disk,
        offload_prefetch=cfg.zero.offload_prefetch, micro_steps=cfg.data.grad_accum_steps,
        tier_io=io_bytes(cfg.zero) if disk else 0,
        update_temp=0 if compiled else UPDATE_TEMP_BYTES,
        largest_unit=max(numels),
        widest_param=widest, reduce_bytes=policy.reduce_dtype.itemsize, gather_bytes=gather,
        in_flight=cfg.zero.in_flight(device_type), prefetch=cfg.zero.prefetch,
        secondary_partition=(cfg.zero.secondary_partition or 0) if "params" in cls.shards else 0,
        grad_wire_bits={"int8": 8, "int4": 4}.get(cfg.zero.grad_wire, 0)
        if "params" in cls.shards else 0,
        high_water=cpu, lazy_grads=cpu,
        init_piece=widest if plan.init is not None else None,
        runtime=COMPILE_RUNTIME_BYTES if compiled else 0,
        retention=CPU_RETENTION if cpu else 0.0, stage=cls.stage)
