"""Expert parallelism (`model.moe.expert_parallel: P`): each expert lives on one rank.

Layout, for a world of W = D·P ranks:

- the EP group of rank r is the P consecutive ranks [r - r % P, r - r % P + P); rank r
  is its slot q = r % P and holds experts [q·E/P, (q+1)·E/P) of every MoE layer
  (parameters `gate_up` [E/P, 2I, d], `down` [E/P, d, I]);
- its expert-data-parallel (EDP) group is the D ranks with the same slot
  {q, q+P, q+2P, ...}: they hold the same experts, and ZeRO shards those over them
  (zero/experts.py), while every other parameter is sharded over all W ranks.

A forward (`dispatch`), per MoE layer, every rank, whatever the routing:

1. counts: an equal-size all-to-all of the [P, E/P] pair counts (what each rank sends
   to each expert), so every rank knows what it will receive — the only thing the
   uneven exchange needs, and the same collective on every rank;
2. the (token, expert) pairs' hidden states go to their experts' ranks (an uneven
   all-to-all: `comm.autograd.all_to_all_rows`, purpose "experts", byte-counted);
3. the local experts run on what arrived, re-sorted by expert (each expert's matmul
   runs, on an empty slice when it got nothing: its gradient exists on every rank);
4. the outputs go back by the reverse all-to-all.

Backward: the two row exchanges again, reversed (the autograd function's backward).
So per layer and step a rank sends 2·(pairs it routes to other ranks) rows forward and
receives as many back in backward, each row d elements of the activation dtype, plus
the counts. A rank with no tokens sends and receives nothing but still joins every
collective: no routing can make ranks part (the lockstep check covers the exchange).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.comm.autograd import all_to_all_rows


def ep_slot(parallel: int) -> int:
    """This rank's slot in its EP group (rank % P); 0 without a process group."""
    if parallel <= 1:
        return 0
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() % parallel
    return 0


def one_process_whole(cfg: Any) -> Any:
    """A model config as one process builds it: every expert here (EP 1) when no process
    group of more than one rank is open — sampling, export, a resumed model in one
    process read whole tensors; expert parallelism is a layout of multi-rank training."""
    import torch.distributed as dist

    moe = getattr(cfg, "moe", None)
    if moe is None or moe.expert_parallel == 1:
        return cfg
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return cfg
    return cfg.model_copy(update={"moe": moe.model_copy(update={"expert_parallel": 1})})


def ep_ranks(rank: int, world: int, parallel: int) -> list[int]:
    """The P consecutive ranks that hold, between them, every expert (rank's group)."""
    start = rank - rank % parallel
    return list(range(start, start + parallel))


def edp_ranks(rank: int, world: int, parallel: int) -> list[int]:
    """The D = W/P ranks that hold the same experts as `rank`."""
    return list(range(rank % parallel, world, parallel))


class _Group:
    """The EP group's Comm, held by a module without being copied with it (an EMA's deep
    copy shares it; a process group cannot be copied)."""

    def __init__(self, comm: object):
        self.comm = comm

    def __deepcopy__(self, memo: dict) -> _Group:
        return self


def attach(experts: nn.Module, comm: object) -> None:
    """Give an `Experts` module its EP group (`comm`: the P ranks of its layer)."""
    local = experts.total // experts.expert_parallel
    if comm.world_size != experts.expert_parallel or experts.first != comm.rank * local:
        raise ValueError(f"expert parallelism: this rank holds experts from "
                         f"{experts.first}, but is slot {comm.rank} of a "
                         f"{comm.world_size}-rank group (built before the process group "
                         "opened?): build the model after init_distributed")
    experts._ep_group = _Group(comm)


def group_of(experts: nn.Module) -> object:
    g = experts.__dict__.get("_ep_group")
    if g is None:
        raise RuntimeError(f"model.moe.expert_parallel {experts.expert_parallel}: the "
                           "experts have no EP group; train the model through the "
                           "zerotrain Engine, which makes it")
    return g.comm


def dispatch(experts: nn.Module, xs: Tensor, counts: Tensor, compute=None) -> Tensor:
    """The experts' outputs for pairs `xs` (sorted by global expert, `counts[e]` each),
    computed on the experts' ranks (module doc) by `compute(rows, local_counts)` (default:
    calling `experts`); differentiable, same order as `xs`."""
    comm = group_of(experts)
    P, L = comm.world_size, experts.total // experts.expert_parallel
    send_counts = counts.to(torch.int64).view(P, L).contiguous()
    wire = send_counts.to(comm.device)
    recv_counts = torch.empty_like(wire)
    comm.all_to_all(recv_counts, wire, purpose="experts").wait()
    recv_counts = recv_counts.cpu()
    send = send_counts.sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    got = all_to_all_rows(comm, xs, send, recv)
    # arrived: by source rank, then local expert; the experts want expert-major
    seg = torch.repeat_interleave(torch.arange(P * L), recv_counts.reshape(-1))
    order = torch.argsort(seg % L, stable=True).to(xs.device)
    ys = (compute or experts)(got[order], recv_counts.sum(0).tolist())
    back = ys[torch.argsort(order)]
    return all_to_all_rows(comm, back, recv, send)


def whole_shapes(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """By parameter id: the whole layer's shape of every expert-parallel parameter (what a
    weights file holds; this rank holds rows [first, first + E/P) of it)."""
    return {id(p): (p.shape[0] * m.expert_parallel, *p.shape[1:])
            for m in model.modules() if getattr(m, "expert_parallel", 1) > 1
            for p in m.parameters(recurse=False)}


def whole_numel(model: nn.Module) -> int:
    """The whole model's parameter count from one rank's: its experts times P."""
    mods = [m for m in model.modules() if getattr(m, "expert_parallel", 1) > 1]
    extra = sum(p.numel() * (m.expert_parallel - 1) for m in mods for p in m.parameters())
    return sum(p.numel() for p in model.parameters()) + extra


def describe(model: nn.Module) -> str | None:
    """The run's start line about expert parallelism, or None without it."""
    mods = [m for m in model.modules() if getattr(m, "expert_parallel", 1) > 1]
    if not mods:
        return None
    m = mods[0]
    P, E = m.expert_parallel, m.total
    return (f"expert parallel {P}: this rank holds experts {m.first}..{m.first + E // P - 1} "
            f"of {E} in each of {len(mods)} layers; tokens reach them by all-to-all, "
            f"expert states are sharded over the ranks holding the same experts "
            f"(ranks {m.first // (E // P)}, {m.first // (E // P) + P}, ...)")
