"""ZeRO under expert parallelism: expert parameters are sharded over the ranks holding
the same experts, everything else over every rank (layout: models/moe_parallel.py).

`setup` makes the groups (the EP group of P consecutive ranks for the all-to-all; the
expert-data-parallel group of the D = W/P ranks with the same slot for ZeRO) and gives
the model's experts their EP group. `split` takes a stage's cut and moves each expert
parameter into a unit of its own, cut across an `ExpertPartition` (the EDP group); the
strategy then talks to each unit's own ranks (`unit.part.comm`).

Gradients: the loss is already scaled by 1/W (the engine), and an expert's gradient on
its owner sums every token of its EP group routed to it; summing that over the D ranks
of the EDP group adds every token of the world once — the EP = 1 average, with no
further division. Norm: dense shards partition each dense tensor over W ranks, expert
shards each slot's experts over its D ranks, so one world all-reduce of the local
norm² counts every element once (sharded stages); at stage 0 every rank holds its
units whole, so each unit counts 1/(ranks that hold it) before the all-reduce.

Checkpoints store full tensors by name: an expert unit shows the checkpoint its whole
parameter ([E, ...]) with this rank's range shifted to its slot's rows (`unit_layout`,
`ranges`), so a checkpoint saved at one EP degree or world size resumes at another and
exports as one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from zerotrain.config.base import ConfigError
from zerotrain.models import moe_parallel
from zerotrain.zero.partition import Partition

if TYPE_CHECKING:
    from zerotrain.comm.collectives import Comm
    from zerotrain.zero.unit import Unit

#: (unit name, its (name, parameter, group) entries, extra Unit fields): zero/cut.py's
UnitSpec = tuple[str, list, dict]


@dataclass(frozen=True)
class ExpertPartition(Partition):
    """The EDP group an expert unit is sharded over, and the EP slot whose experts it
    holds (of `slots` = P)."""

    slot: int = 0
    slots: int = 1


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose parameters are split across an EP group (P > 1)."""
    return [m for m in model.modules() if getattr(m, "expert_parallel", 1) > 1]


def ep_problem(parallel: int, world: int) -> str | None:
    """Why `model.moe.expert_parallel` cannot run on `world` ranks, or None."""
    if world % parallel:
        return (f"model.moe.expert_parallel ({parallel}) must divide the world size "
                f"({world}): use a divisor of {world}, or run on a multiple of "
                f"{parallel} ranks")
    return None


def setup(model: nn.Module, comm: Comm) -> ExpertPartition | None:
    """Make the EP and EDP groups (collective: every rank, same order), attach the EP
    group to the model's experts; the EDP partition, or None without EP."""
    mods = expert_modules(model)
    if not mods:
        return None
    P = mods[0].expert_parallel
    problem = ep_problem(P, comm.world_size)
    if problem:
        raise ConfigError(problem)
    ep = comm.split(P)
    W = comm.world_size
    groups = [comm.subgroup(list(range(q, W, P))) for q in range(P)]
    edp = next(g for g in groups if g is not None)
    if comm.lockstep is not None and edp.lockstep is not None:
        edp.lockstep = comm.lockstep.channel("expert-data-parallel groups")
    for m in mods:
        moe_parallel.attach(m, ep)
    return ExpertPartition(edp.world_size, edp.rank, edp, slot=ep.rank, slots=P)


def split(specs: list[UnitSpec], model: nn.Module, part: Partition,
          expert_part: ExpertPartition) -> tuple[list[UnitSpec], list[Partition]]:
    """Each expert parameter out of its unit into one of its own (named after it, driven
    by its experts module under ZeRO-3), cut across `expert_part`; the rest unchanged."""
    owner = {id(p): m for m in expert_modules(model) for p in m.parameters()}
    out: list[UnitSpec] = []
    parts: list[Partition] = []
    for name, ps, extra in specs:
        dense = [t for t in ps if id(t[1]) not in owner]
        if dense:
            out.append((name, dense, extra))
            parts.append(part)
        for t in ps:
            if id(t[1]) in owner:
                more = {**extra, "module": owner[id(t[1])]} if "module" in extra else extra
                out.append((f"{name}.{t[0]}", [t], more))
                parts.append(expert_part)
    return out, parts


def slot_of(u: Unit) -> tuple[int, int] | None:
    """(slot, P) of an expert unit; None for any other."""
    p = u.part
    return (p.slot, p.slots) if isinstance(p, ExpertPartition) else None


def unit_layout(u: Unit) -> dict[str, Any]:
    """What a checkpoint sees of `u`: an expert unit as its whole parameter."""
    layout = u.layout()
    where = slot_of(u)
    if where is None:
        return layout
    (name, shape, _off, group), = layout["params"]
    full = u.numel * where[1]
    return {"name": u.name, "numel": full, "padded_numel": full + u.padded_numel - u.numel,
            "params": [[name, [shape[0] * where[1], *shape[1:]], 0, group]]}


def ranges(u: Unit, lo: int, hi: int, clip: bool = False) -> tuple[int, int]:
    """[lo, hi) of `u`'s own coordinates in `unit_layout`'s; `clip`: without the padding
    (an expert slot's padding is the next slot's rows there)."""
    where = slot_of(u)
    if where is None:
        return lo, hi
    if clip:
        hi = min(hi, u.numel)
        lo = min(lo, hi)
    k = where[0] * u.numel
    return lo + k, hi + k


def grad_norm_sq(strategy: Any) -> float | None:
    """The world's gradient norm² when some units are expert units (else None: the
    strategy's own rule): see the module doc."""
    units = strategy.units
    if not any(slot_of(u) is not None for u in units):
        return None
    total = 0.0
    for u in units:
        local = float(strategy.grads.norm_sq([u], lambda u=u: [strategy.owned_grad(u)],
                                             strategy.host))
        total += local if strategy.shards_optimizer else local / u.part.world
    return float(strategy.comm.all_reduce_scalars([total])[0])
