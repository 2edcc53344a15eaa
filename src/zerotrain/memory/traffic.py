"""Bytes each rank sends per optimizer step (docs/design.md §ring, §zero), and the α–β
time they take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from zerotrain.memory.shape import RunShape
from zerotrain.memory.states import BytesPerParam, shard_numel
from zerotrain.memory.tiers import tier_traffic
from zerotrain.numerics.wire_quant import encoded_bytes

# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class CollectiveCost:
    """What one rank sends for one kind of collective, and in how many message rounds.

    α–β time = rounds·α + sent_bytes/β: every round each rank sends one message on its
    own link, all links busy at once, so the slowest link is the step's time.
    """

    op: str
    what: str
    sent_numel: int
    sent_bytes: int
    rounds: int

    def time_s(self, bandwidth_gbps: float, latency_us: float) -> float:
        return self.rounds * latency_us * 1e-6 + self.sent_bytes / (bandwidth_gbps * 1e9)


def collective_cost(op: str, numels: int | Sequence[int], world: int, elem_bytes: int, *,
                    algorithm: str = "ring", what: str = "") -> CollectiveCost:
    """Ring: a reduce-scatter or all-gather is N−1 rounds of one ceil(P/N) chunk; all-reduce
    is both (2(N−1)/N·P). Naive all-reduce: each rank sends its whole buffer to each of the
    N−1 others, one after another on its link ((N−1)·P, N−1 rounds)."""
    sizes = [numels] if isinstance(numels, int) else list(numels)
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective '{op}'")
    if algorithm not in ("ring", "naive"):
        raise ValueError(f"unknown algorithm '{algorithm}'; choose ring or naive")
    steps = world - 1
    if algorithm == "naive" and op == "all_reduce":
        sent, rounds = steps * sum(sizes), steps * len(sizes)
    else:
        phases = 2 if op == "all_reduce" else 1
        sent = phases * steps * sum(shard_numel(p, world) for p in sizes)
        rounds = phases * steps * len(sizes)
    return CollectiveCost(op, what, sent, sent * elem_bytes, rounds)


@dataclass
class Traffic:
    """Bytes one rank sends per optimizer step, plus host↔device copies under offload."""

    collectives: list[CollectiveCost]
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0

    @property
    def sent_numel(self) -> int:
        return sum(c.sent_numel for c in self.collectives)

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    def time_s(self, bandwidth_gbps: float, latency_us: float) -> float:
        return sum(c.time_s(bandwidth_gbps, latency_us) for c in self.collectives)


def collective_traffic(numels: Sequence[int], world: int, shards: frozenset[str], *,
                       param_bytes: int, grad_bytes: int, algorithm: str = "ring",
                       muon_matrix_numel: int = 0, update_bytes: int = 4,
                       gather_bytes: Sequence[int] = ()) -> list[CollectiveCost]:
    """SPEC §6 traffic column, from what a strategy shards (`shards`, of memory.FIELDS):
    nothing sharded (DDP) all-reduces the gradients, 2Ψ; sharding anything reduce-scatters
    them and all-gathers the parameters — once, after the update, when they are
    replicated (ZeRO-1/2: 2Ψ), for every forward and every backward when they are sharded
    (ZeRO-3: 3Ψ); each ×(N−1)/N, in elements. A sharded optimizer running distributed Muon
    (`muon_matrix_numel`: elements of the matrices owned whole) adds its two all-to-alls.
    `gather_bytes`: each unit's bytes as ZeRO-3's parameter wire sends them (an FP8 or int8
    wire), in place of `param_bytes` per element."""
    n = world
    if not shards:
        return [collective_cost("all_reduce", list(numels), n, grad_bytes,
                                algorithm=algorithm, what="grads")]
    gathers = ["params (fwd)", "params (bwd)"] if "params" in shards else ["params"]
    colls = [collective_cost("reduce_scatter", list(numels), n, grad_bytes, what="grads")]
    colls += [_gather_cost(list(numels), n, param_bytes, w,
                           gather_bytes if "params" in shards else ()) for w in gathers]
    if muon_matrix_numel and "optimizer" in shards:
        colls += muon_mean_traffic(muon_matrix_numel, n, grad_bytes=grad_bytes,
                                   update_bytes=update_bytes)
    return colls


def _gather_cost(numels: list[int], world: int, param_bytes: int, what: str,
                 wire: Sequence[int]) -> CollectiveCost:
    """An all-gather of the units, each chunk sent as its wire packs it (ceil(bytes/N) a
    round, like the elements) when the wire is not the plain dtype."""
    cost = collective_cost("all_gather", numels, world, param_bytes, what=what)
    if not wire:
        return cost
    return replace(cost, sent_bytes=collective_cost("all_gather", list(wire), world, 1).sent_bytes)


def shape_traffic(shape: RunShape, *, algorithm: str = "ring", muon_matrix_numel: int = 0,
                  update_bytes: int = 4) -> Traffic:
    """What one rank sends per step for a run of this shape, and the host↔device copies of
    its offload tiers (`tier_traffic`): Offload keeps the collectives of its stage and adds
    a grad shard down and a param shard up; parameters off the device come up for every
    forward and backward."""
    colls = collective_traffic(shape.buffer_numels, shape.world, shape.shards,
                               param_bytes=shape.bpp.params, grad_bytes=shape.bpp.grads,
                               algorithm=algorithm, muon_matrix_numel=muon_matrix_numel,
                               update_bytes=update_bytes, gather_bytes=shape.gather_bytes)
    tiers = tier_traffic(shape)
    return Traffic(colls, tiers.device_to_host, tiers.host_to_device)


def node_traffic(shape: RunShape, node_size: int) -> tuple[int, int]:
    """(bytes sent, of which to another node) per rank per step, as the comm layer counts
    them (`Engine.last_traffic_bytes`, `last_inter_bytes`) with `node_size` ranks per node
    and torch's native collectives: a rank exchanges equal shares with every peer, so
    (N − node)/(N − 1) of a collective over all N ranks crosses nodes. ZeRO++ changes
    three rows: hpZ's backward gather runs inside a group of K ranks of one node; qgZ's
    reduce-scatter runs inside the node in full precision, then sends each other node its
    piece as block codes (numerics/wire_quant.py); qwZ is already in `gather_bytes`."""
    n, sh = shape.world, shape
    cross = (n - node_size) / (n - 1) if n > 1 else 0.0
    total = inter = 0.0
    for c in shape_traffic(shape).collectives:
        if c.what == "params (bwd)" and sh.secondary_partition:
            k = sh.secondary_partition
            total += sum((k - 1) * (n * shard_numel(p, n) // k) for p in sh.buffer_numels) \
                * sh.bpp.params
        elif c.what == "grads" and sh.grad_wire_bits and n > node_size:
            nodes = n // node_size
            for p in sh.buffer_numels:
                s = shard_numel(p, n)
                a2a = (nodes - 1) * encoded_bytes(s, sh.grad_wire_bits)
                total += (node_size - 1) * nodes * s * sh.reduce_bytes + a2a
                inter += a2a
        else:
            total += c.sent_bytes
            inter += c.sent_bytes * cross
    return round(total), round(inter)


def traffic_per_step(psi: int | Sequence[int], world_size: int, stage: int, *,
                     param_bytes: int, grad_bytes: int, offload: bool = False,
                     algorithm: str = "ring", muon_matrix_numel: int = 0,
                     update_bytes: int = 4) -> Traffic:
    """`shape_traffic` by stage number (SPEC §6's table): DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ.
    ZeRO-1 does not all-reduce: reduce-scatter grads, then all-gather the updated params.
    `muon_matrix_numel`: elements of the matrices distributed Muon owns whole (stages
    1–3 add its two all-to-alls, `muon_mean_traffic`; stage 0 replicates Muon: nothing).
    """
    sizes = [psi] if isinstance(psi, int) else list(psi)
    shape = RunShape.for_stage(sizes, world_size, stage,
                               BytesPerParam(param_bytes, grad_bytes, 0, 0), offload=offload)
    return shape_traffic(shape, algorithm=algorithm, muon_matrix_numel=muon_matrix_numel,
                         update_bytes=update_bytes)


# ----------------------------------------------------------------------------- Muon
# Distributed Muon (zero/muon.py, stages 1–3): each matrix is owned whole by one rank.
# Per step, two all-to-alls: the reduced gradient pieces to the
# owners, the orthogonalised update O back to the ranks holding the master slices.

def muon_traffic(pieces: Sequence[tuple[int, Sequence[int]]], rank: int, *, grad_bytes: int,
                 update_bytes: int = 4) -> list[CollectiveCost]:
    """What `rank` sends in distributed Muon's two all-to-alls, exactly, from the ownership
    table: per matrix (owner, its elements on each rank's shard). Gradients: every piece
    this rank holds of a matrix another rank owns. Updates: every piece of this rank's
    own matrices that another rank holds."""
    grads = sum(sizes[rank] for owner, sizes in pieces if owner != rank)
    updates = sum(sum(sizes) - sizes[rank] for owner, sizes in pieces if owner == rank)
    rounds = len(pieces[0][1]) - 1 if pieces else 0
    return [CollectiveCost("all_to_all", "muon grads", grads, grads * grad_bytes, rounds),
            CollectiveCost("all_to_all", "muon updates", updates, updates * update_bytes,
                           rounds)]


def muon_mean_traffic(matrix_numel: int, world_size: int, *, grad_bytes: int,
                      update_bytes: int = 4) -> list[CollectiveCost]:
    """`muon_traffic` averaged over ranks: a matrix's owner holds 1/N of it on average,
    so (N−1)/N of it travels each way, spread over N senders: (N−1)/N²·Ψ_mat per rank."""
    n = world_size
    each = matrix_numel * (n - 1) // (n * n)
    return [CollectiveCost("all_to_all", "muon grads", each, each * grad_bytes, n - 1),
            CollectiveCost("all_to_all", "muon updates", each, each * update_bytes, n - 1)]
