"""A strategy's units, finished before the strategy exists: cut → materialise →
gradients → masters, one unit at a time (a meta-built model never exists in full).

`build_units` is the only code that fills units. It reads the stage class's
declarations (`shards`, `cut`, `grads_class`) and the chosen parts (the placement), and
hands the strategy units that hold their parameters, gradient storage and master
weights — so no strategy constructor calls a subclass hook before the subclass is
ready, and ZeRO-3's scratch buffer is a local of this module, not class state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero import experts
from zerotrain.zero.cut import align_for, trainable
from zerotrain.zero.init import InitValues
from zerotrain.zero.partition import Partition
from zerotrain.zero.states.grads import FullGrads
from zerotrain.zero.states.home import Placement
from zerotrain.zero.unit import ShardedUnit, Unit


class Masters:
    """Where master weights live: the placement's buffers (beside the parameters, or
    Offload's pinned host memory)."""

    def __init__(self, policy: PrecisionPolicy, placement: Placement, separate: bool = False,
                 share: bool = False):
        """`separate`: a master is never the parameters themselves (a tier moves those);
        `share`: it is, wherever the placement puts masters (ZeRO-Infinity's shared
        tier, zero/states/disk.py `Tiers.shares`)."""
        self.policy, self.placement = policy, placement
        self.separate, self.share = separate, share

    def master_for(self, own: Tensor) -> Tensor:
        """The optimizer's copy of the weights in `own`: a separate FP32 (or host) tensor
        in mixed precision or Offload; otherwise `own` itself — the parameters are their
        own master (fp32, bf16-pure)."""
        if self.share:
            return own
        if self.policy.has_master or "master" in self.placement.offloads or self.separate:
            master = self.placement.zeros(own.numel(), self.policy.master_dtype or own.dtype)
            master.copy_(own)
            return master
        return own


def build_units(cls: Any, model: nn.Module, plan: Plan, policy: PrecisionPolicy,
                part: Partition, cfg: ZeroConfig, device: torch.device, init: InitValues,
                placement: Placement, tiers: Any = None,
                expert_part: Partition | None = None) -> list[Unit]:
    """Every unit of `cls`'s cut, materialised, with gradient storage and a master (both
    where `placement` puts them; its `grads` is the store made by `make_grads`); with
    ZeRO-Infinity's `tiers` (zero/states/disk.py), each unit goes to its tiers once built;
    with expert parallelism, expert parameters in units of their own cut across
    `expert_part` (zero/experts.py)."""
    grads = placement.grads
    assert grads is not None, "the placement makes the gradient store first"
    named = trainable(model, plan)
    if not named:
        raise ValueError("the model has no trainable parameters")
    place_rest(model, device, policy.param_dtype, plan.init_buffers)
    align = align_for(device.type, policy)
    specs = cls.cut(model, plan, named, cfg, policy)
    parts = [part] * len(specs)
    if expert_part is not None:
        specs, parts = experts.split(specs, model, part, expert_part)
    units = [cls.unit_class.build(i, name, ps, p, align, **extra)
             for i, ((name, ps, extra), p) in enumerate(zip(specs, parts, strict=True))]
    moves = tiers is not None and tiers.moves
    share = moves and tiers.shares(policy.has_master)
    masters = Masters(policy, placement, separate=moves, share=share)
    if "params" in cls.shards:
        if moves:
            tiers.reserve(units, cfg.param_persistence_threshold, policy.param_dtype.itemsize,
                          (policy.master_dtype or policy.param_dtype).itemsize)
        _sharded(units, policy, device, init, grads, masters, cfg.param_persistence_threshold,
                 tiers.place if moves else None)
        return units
    for u in units:
        u.materialize(policy.param_dtype, device, init.fill)
        grads.allocate(u)
        lo, hi = u.shard_range if "optimizer" in cls.shards else (0, u.padded_numel)
        u.master = masters.master_for(u.params[lo:hi])
    return units


def _sharded(units: Sequence[ShardedUnit], policy: PrecisionPolicy, device: torch.device,
             init: InitValues, grads: FullGrads, masters: Masters, threshold: int,
             place: Callable[[ShardedUnit], None] | None = None) -> None:
    """ZeRO-3: each unit keeps this rank's shard; units under `threshold` elements stay
    gathered (persistent); `place(unit)` sends a finished unit to its tiers."""
    scratch: Tensor | None = None  # where each parameter is drawn whole (per-name init)
    for u in units:
        lo, hi = u.shard_range
        u.persistent = u.numel < threshold
        if _by_parameter(u, init):
            if scratch is None:  # one buffer for every parameter drawn: no allocator churn
                widest = max(s.numel for v in units for s in v.slots)
                scratch = torch.empty(widest, dtype=policy.param_dtype, device=device)
            u.shard = _init_shard(u, policy.param_dtype, device, init.plan.init, scratch)
        else:
            u.materialize(policy.param_dtype, device, init.fill)
            # A persistent unit keeps its full buffer, so its shard can be a view of it.
            u.shard = u.params[lo:hi] if u.persistent else u.params[lo:hi].clone()
        grads.allocate(u)
        u.master = masters.master_for(u.shard)
        u.reshard()
        if place is not None:
            place(u)


def _by_parameter(u: ShardedUnit, init: InitValues) -> bool:
    """A meta unit whose values come from the plan's per-name rule is initialised one
    parameter at a time, straight into this rank's shard: the full unit never exists
    at init (a persistent unit keeps its full buffer anyway; `reset_parameters()` and
    pretrained loading fill whole modules or slices, so they take the unit path)."""
    return (not u.persistent and init.per_name
            and all(s.param.device.type == "meta" for s in u.slots))


def _init_shard(u: ShardedUnit, dtype: torch.dtype, device: torch.device,
                rule: Callable[[str, Tensor], None], scratch: Tensor) -> Tensor:
    """This rank's shard of a meta unit, each parameter drawn whole (the same values
    as in the full buffer: the rule depends on the name only) and its owned slice
    kept; the full buffer is an empty tensor the first gather fills."""
    lo, hi = u.shard_range
    shard = torch.zeros(hi - lo, dtype=dtype, device=device)
    with torch.no_grad():
        for s in u.slots:
            a, b = max(s.offset, lo), min(s.end, hi)
            if a < b:
                full = scratch[:s.numel].view(s.shape)
                rule(s.name, full)
                shard[a - lo:b - lo].copy_(full.view(-1)[a - s.offset:b - s.offset])
    # untouched pages: reshard() releases the storage before anything reads it
    u.params = torch.empty(u.padded_numel, dtype=dtype, device=device)
    u.point_params_at(u.params)
    return shard


def place_rest(model: nn.Module, device: torch.device, dtype: torch.dtype,
               init_buffers: Callable[[nn.Module], None] | None = None) -> None:
    """Move what the units do not own — buffers and frozen parameters — to the device
    (floating frozen parameters in the compute dtype), without touching trainable
    parameters. Buffers keep their dtype, as DeepSpeed keeps them: an fp32 rotary
    `inv_freq` cast to bf16 would shift every position's angle. Buffers of a meta-device
    model are made on the device and filled by `init_buffers`."""
    fresh = []
    with torch.no_grad():
        for m in model.modules():
            for name, b in m.named_buffers(recurse=False):
                if b is None:
                    continue
                if b.device.type == "meta":
                    m._buffers[name] = torch.empty_like(b, device=device)
                    fresh.append(m)
                else:
                    m._buffers[name] = b.to(device)
            for p in m.parameters(recurse=False):
                if not p.requires_grad:
                    p.data = p.data.to(device, dtype if p.is_floating_point() else None)
    for m in dict.fromkeys(fresh):
        if init_buffers is None:
            raise ValueError(f"{type(m).__name__} has buffers on the meta device and the model's "
                             "plan cannot make them (Plan.init_buffers); build it on a real device")
        init_buffers(m)
