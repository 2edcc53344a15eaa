"""Distributed Muon: each weight matrix is updated whole, by the one rank that owns it.

Muon's update of a matrix is a Newton–Schulz iteration on its whole momentum, so a ZeRO
shard holding a flat slice of the matrix cannot compute its own part. Every matrix of the
plan's MATRIX group (2-D and up) gets one owner rank, chosen once from the shapes alone:
longest-processing-time first on the cost of one iteration, ~ m·n·min(m, n). Each step,
after `finish_backward` has waited for every reduction of the step (so no gradient is
read half reduced — DeepSpeed's bug with matrices that straddle a partition):

1. every rank sends the reduced gradient pieces it holds to their matrices' owners
   (one all-to-all: a piece of the gradient shard travels at most once);
2. the owner assembles each full gradient, and the unchanged `Muon` optimizer updates
   the momentum and writes the orthogonalised update O into a full-shape stand-in (its
   group's `defer_update`), so the math stays in `optim/functional.py`;
3. O goes back in pieces to the ranks holding the matrix's master slices, which apply
   θ ← θ(1 − ηλ) − η'·O elementwise (`functional.muon_apply_`): the same arithmetic per
   element as one process applying it to the whole matrix.

Why all-to-all for step 3 (bench/muon.py measures the three): it sends each element of
O once, to the one rank that needs it — per rank about (N−1)/N² of the matrix elements,
in one collective. Gather-then-keep-slice (all-gather every owner's O, keep one's own
slices) sends N times those bytes; scatter from each owner sends the same bytes as the
all-to-all but in N collectives one after another, each padded to its largest piece.
Only O travels, never weights: θ's slices stay where ZeRO put them.

Tensors of other groups keep the AdamW fallback on their elementwise shards. The owner's
stand-ins are optimizer tensors whose segment covers the matrix's whole flat range, so a
checkpoint saves each momentum as [unit, offset, offset + numel, shape] and
`checkpoint.reshard.SavedShards` cuts it again for any world size or stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zerotrain.models.plan import Group
from zerotrain.optim.muon import muon_apply_
from zerotrain.zero.flat import ParamSlot, Segment
from zerotrain.zero.update import Updater

if TYPE_CHECKING:
    from zerotrain.zero.unit import Unit

METHODS = ("all_to_all", "scatter", "all_gather")
MATRIX = int(Group.MATRIX)


def ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton–Schulz iteration on an m×n matrix, ~ m·n·min(m, n):
    X·Xᵀ and B·X cost min²·max each, A·A costs min³ (functional.newton_schulz works on
    the smaller Gram matrix). The min³ term makes a square matrix 3/2 times as costly
    as m·n·min alone says, relative to a very wide one — it matters for balance when
    square attention projections sit beside wide MLP matrices."""
    m, n = shape[0], math.prod(shape[1:])
    lo, hi = min(m, n), max(m, n)
    return 2 * lo * lo * hi + lo ** 3


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """Longest processing time first: the costliest matrix goes to the least-loaded rank
    (the lowest rank on ties). A function of the costs alone, so every rank — and a run
    resumed at the same world size — computes the same owners."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def is_muon_matrix(slot: ParamSlot) -> bool:
    """Muon's rule (`use_muon` None: 2+ dims) on the group engine.group_hyperparameters
    gives to Muon; every other tensor takes the AdamW fallback."""
    return slot.group == MATRIX and len(slot.shape) >= 2


@dataclass(frozen=True)
class Matrix:
    unit: int
    slot: ParamSlot
    owner: int
    pieces: tuple[tuple[int, int], ...]  # rank r's [a, b) of the matrix (flat, from 0)

    def size_on(self, r: int) -> int:
        a, b = self.pieces[r]
        return b - a

    @property
    def straddles(self) -> bool:
        return sum(1 for a, b in self.pieces if a < b) > 1


def _pieces(u: Unit, slot: ParamSlot) -> tuple[tuple[int, int], ...]:
    out = []
    for r in range(u.world_size):
        lo, hi = r * u.shard_numel, (r + 1) * u.shard_numel
        a, b = max(lo, slot.offset), min(hi, slot.end)
        out.append((a - slot.offset, b - slot.offset) if a < b else (0, 0))
    return tuple(out)


class MatrixOwners(Updater):
    """The ownership plan of one strategy, and the exchange that carries it out.

    `strategy` is the `zero.base.Strategy` that builds this, seen through
    `zero.update.StepView`: its units, comm, `opt_range`, `owned_grad`, `attach_grads`."""

    per_param = True

    def __init__(self, strategy: Any, method: str = "all_to_all"):
        super().__init__(strategy)
        if method not in METHODS:
            raise ValueError(f"distributed Muon method must be one of {METHODS}, got {method!r}")
        s = self.s
        self.method = method
        self.rank, self.world = s.rank, s.world
        found = [(u, slot) for u in s.units for slot in u.slots if is_muon_matrix(slot)]
        costs = [ns_cost(slot.shape) for _, slot in found]
        owners = assign_owners(costs, self.world)
        self.matrices = [Matrix(u.index, slot, o, _pieces(u, slot))
                         for (u, slot), o in zip(found, owners)]
        self.loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(self.world)]
        self.by_owner = [[m for m in self.matrices if m.owner == r] for r in range(self.world)]
        self.owned = self.by_owner[self.rank]
        self.owned_numel = sum(m.slot.numel for m in self.owned)
        dtype = s.units[0].master.dtype
        # The stand-ins are views of one flat buffer that has storage only during a step.
        self._work = torch.empty(self.owned_numel, dtype=dtype, device=s.host)
        self._base = _offsets([m.slot.numel for m in self.owned])
        self.stand_ins = [self._work[b:b + m.slot.numel].view(m.slot.shape)
                          for m, b in zip(self.owned, self._base)]
        self._free()
        self.elementwise: list[tuple[Segment, Tensor]] = []

    # ------------------------------------------------------------ what the optimizer sees
    def views(self) -> list[tuple[Segment, Tensor]]:
        """The strategy's per-parameter views without any piece of a matrix, plus one
        full-shape stand-in per matrix this rank owns (in optimizer order: by group)."""
        views = super().views()
        spans = {(m.unit, m.slot.offset, m.slot.end) for m in self.matrices}

        def in_matrix(seg: Segment) -> bool:
            return any(u == seg.unit and a <= seg.start and seg.end <= b for u, a, b in spans)

        self.elementwise = [(seg, v) for seg, v in views if not in_matrix(seg)]
        mine = [(Segment(m.unit, m.slot.group, m.slot.offset, m.slot.end, m.slot), w)
                for m, w in zip(self.owned, self.stand_ins)]
        return sorted(self.elementwise + mine, key=lambda sv: sv[0].group)

    def param_groups(self, groups: list[dict], options: dict[int, dict]) -> list[dict]:
        """Every rank gets the matrix group (empty where it owns nothing: its lr and decay
        still apply the owners' updates), marked `defer_update`."""
        for g in groups:
            if g["group_id"] != MATRIX and g.get("use_muon") is not False:
                raise ValueError(f"optimizer group {g['group_id']} must set use_muon=False "
                                 "under sharded Muon: only the MATRIX group is orthogonalised")
        if MATRIX not in options:
            return groups
        if options[MATRIX].get("use_muon") is False:
            raise ValueError("the MATRIX optimizer group has use_muon=False, but sharded Muon "
                             "owns its matrices; give it use_muon None")
        mat = next((g for g in groups if g["group_id"] == MATRIX), None)
        if mat is None:
            mat = {"params": [], **options[MATRIX], "group_id": MATRIX}
            groups = sorted([*groups, mat], key=lambda g: g["group_id"])
        mat["defer_update"] = True
        return groups

    # ------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """attach → step → detach, with the matrices' exchange around the step."""
        s = self.s
        if not self.matrices:  # a model without matrices: nothing to exchange
            s.attach_grads()
            optimizer.step()
            s.detach_grads()
            return
        grads = self.gather_grads()
        s.attach_grads(self.elementwise)
        self._grow()
        for w, g in zip(self.stand_ins, grads):
            w.grad = g
        optimizer.step()
        s.detach_grads()
        group = next(g for g in optimizer.param_groups if g.get("group_id") == MATRIX)
        self.apply(self.spread(), group)
        self._free()

    def gather_grads(self) -> list[Tensor]:
        """All-to-all: each rank's reduced pieces to the owners; the owned full gradients."""
        s, n = self.s, self.world
        send = [self._grad_piece(m) for d in range(n) for m in self.by_owner[d]
                if m.size_on(self.rank)]
        in_splits = [sum(m.size_on(self.rank) for m in self.by_owner[d]) for d in range(n)]
        out_splits = [sum(m.size_on(src) for m in self.owned) for src in range(n)]
        dtype = s.units[0].grad.dtype
        sendbuf = _cat(send, dtype, s.device)
        recv = torch.empty(sum(out_splits), dtype=dtype, device=s.device)
        s.comm.all_to_all(recv, sendbuf, out_splits, in_splits).wait()
        full = torch.empty(self.owned_numel, dtype=self._work.dtype, device=s.host)
        pos = 0
        for src in range(n):
            for m, base in zip(self.owned, self._base):
                a, b = m.pieces[src]
                full[base + a:base + b].copy_(recv[pos:pos + b - a])
                pos += b - a
        return [full[b:b + m.slot.numel].view(m.slot.shape) for m, b in zip(self.owned, self._base)]

    def _grad_piece(self, m: Matrix) -> Tensor:
        u = self.s.units[m.unit]
        lo = self.s.opt_range(u)[0]
        a, b = m.pieces[self.rank]
        return self.s.owned_grad(u)[m.slot.offset + a - lo:m.slot.offset + b - lo]

    def spread(self) -> list[tuple[Matrix, Tensor]]:
        """Every owner's O to the ranks holding the matrix: (matrix, this rank's piece)."""
        if self.method == "all_gather":
            return self._spread_all_gather()
        if self.method == "scatter":
            return self._spread_scatter()
        s, n = self.s, self.world
        flat = [w.reshape(-1) for w in self.stand_ins]
        send = [f[slice(*m.pieces[d])] for d in range(n) for m, f in zip(self.owned, flat)]
        in_splits = [sum(m.size_on(d) for m in self.owned) for d in range(n)]
        out_splits = [sum(m.size_on(self.rank) for m in self.by_owner[src]) for src in range(n)]
        sendbuf = _cat(send, self._work.dtype, s.device)
        recv = torch.empty(sum(out_splits), dtype=self._work.dtype, device=s.device)
        s.comm.all_to_all(recv, sendbuf, out_splits, in_splits).wait()
        return self._mine(recv.to(s.host), [m for src in range(n) for m in self.by_owner[src]])

    def _spread_all_gather(self) -> list[tuple[Matrix, Tensor]]:
        """Gather-then-keep-slice: everyone receives every O and keeps its own pieces."""
        s, n = self.s, self.world
        width = max(sum(m.slot.numel for m in ms) for ms in self.by_owner)
        mine = torch.zeros(width, dtype=self._work.dtype, device=s.device)
        mine[:self.owned_numel].copy_(self._work)
        everyone = torch.empty(n * width, dtype=mine.dtype, device=s.device)
        s.comm.all_gather(everyone, mine, purpose="muon").wait()
        out = []
        for src in range(n):
            pos = src * width
            for m in self.by_owner[src]:
                a, b = m.pieces[self.rank]
                if a < b:
                    out.append((m, everyone[pos + a:pos + b].to(s.host)))
                pos += m.slot.numel
        return out

    def _spread_scatter(self) -> list[tuple[Matrix, Tensor]]:
        """One scatter per owner, each rank's pieces padded to the largest rank's."""
        s, n = self.s, self.world
        out = []
        flat = [w.reshape(-1) for w in self.stand_ins]
        for src in range(n):
            width = max(sum(m.size_on(r) for m in self.by_owner[src]) for r in range(n))
            if width == 0:
                continue
            inputs = None
            if src == self.rank:
                inputs = [_pad(_cat([f[slice(*m.pieces[r])] for m, f in zip(self.owned, flat)],
                                    self._work.dtype, s.device), width) for r in range(n)]
            got = torch.empty(width, dtype=self._work.dtype, device=s.device)
            s.comm.scatter(got, inputs, src).wait()
            out += self._mine(got.to(s.host), self.by_owner[src])
        return out

    def _mine(self, recv: Tensor, order: list[Matrix]) -> list[tuple[Matrix, Tensor]]:
        """Cut a received buffer into this rank's pieces of `order`'s matrices."""
        out, pos = [], 0
        for m in order:
            k = m.size_on(self.rank)
            if k:
                out.append((m, recv[pos:pos + k]))
                pos += k
        return out

    def apply(self, pieces: list[tuple[Matrix, Tensor]], group: dict[str, Any]) -> None:
        """θ ← θ(1 − ηλ) − η'·O on this rank's master slice of each matrix."""
        for m, o in pieces:
            u = self.s.units[m.unit]
            self.s.fence_master(u)  # a unit holding only matrix slices had no other fence
            lo = self.s.opt_range(u)[0]
            a, b = m.pieces[self.rank]
            master = u.master[m.slot.offset + a - lo:m.slot.offset + b - lo]
            muon_apply_(master, o, m.slot.shape, lr=group["lr"],
                        weight_decay=group["weight_decay"], adjust_lr_fn=group["adjust_lr_fn"])

    def _grow(self) -> None:
        st = self._work.untyped_storage()
        st.resize_(self.owned_numel * self._work.element_size())

    def _free(self) -> None:
        self._work.untyped_storage().resize_(0)

    # ------------------------------------------------------------ reports
    def summary(self) -> dict[str, Any]:
        total = sum(self.loads) or 1
        return {"method": self.method, "matrices": len(self.matrices), "world": self.world,
                "shares": [ld / total for ld in self.loads],
                "owned": [[m.slot.name for m in ms] for ms in self.by_owner],
                "owned_numel": [sum(m.slot.numel for m in ms) for ms in self.by_owner],
                "straddling": [m.slot.name for m in self.matrices if m.straddles],
                "pieces": [[m.owner, [m.size_on(r) for r in range(self.world)]]
                           for m in self.matrices]}

    def describe(self) -> str:
        share = " ".join(f"{x:.1%}" for x in self.summary()["shares"])
        straddle = sum(m.straddles for m in self.matrices)
        return (f"muon: {len(self.matrices)} matrices owned whole across {self.world} ranks "
                f"({self.method}); Newton–Schulz share per rank: {share}; {straddle} "
                "straddle a shard boundary")


def _offsets(sizes: list[int]) -> list[int]:
    out, pos = [], 0
    for k in sizes:
        out.append(pos)
        pos += k
    return out


def _cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([p.reshape(-1) for p in parts]).to(device=device, dtype=dtype)


def _pad(t: Tensor, width: int) -> Tensor:
    if t.numel() == width:
        return t
    out = torch.zeros(width, dtype=t.dtype, device=t.device)
    out[:t.numel()].copy_(t)
    return out
