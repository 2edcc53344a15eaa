"""Bytes each rank sends per optimizer step (docs/design.md §ring, §zero), and the α–β
time they take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerotrain.memory.shape import RunShape
from zerotrain.memory.states import BytesPerParam, shard_numel
from zerotrain.memory.tiers import tier_traffic

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
                       muon_matrix_numel: int = 0, update_bytes: int = 4
                       ) -> list[CollectiveCost]:
    """SPEC §6 traffic column, from what a strategy shards (`shards`, of memory.FIELDS):
    nothing sharded (DDP) all-reduces the gradients, 2Ψ; sharding anything reduce-scatters
    them and all-gathers the parameters — once, after the update, when they are
    replicated (ZeRO-1/2: 2Ψ), for every forward and every backward when they are sharded
    (ZeRO-3: 3Ψ); each ×(N−1)/N, in elements. A sharded optimizer running distributed Muon
    (`muon_matrix_numel`: elements of the matrices owned whole) adds its two all-to-alls."""
    n = world
    if not shards:
        return [collective_cost("all_reduce", list(numels), n, grad_bytes,
                                algorithm=algorithm, what="grads")]
    gathers = ["params (fwd)", "params (bwd)"] if "params" in shards else ["params"]
    colls = [collective_cost("reduce_scatter", list(numels), n, grad_bytes, what="grads")]
    colls += [collective_cost("all_gather", list(numels), n, param_bytes, what=w)
              for w in gathers]
    if muon_matrix_numel and "optimizer" in shards:
        colls += muon_mean_traffic(muon_matrix_numel, n, grad_bytes=grad_bytes,
                                   update_bytes=update_bytes)
    return colls


def shape_traffic(shape: RunShape, *, algorithm: str = "ring", muon_matrix_numel: int = 0,
                  update_bytes: int = 4) -> Traffic:
    """What one rank sends per step for a run of this shape, and the host↔device copies of
    its offload tiers (`tier_traffic`): Offload keeps the collectives of its stage and adds
    a grad shard down and a param shard up; parameters off the device come up for every
    forward and backward."""
    colls = collective_traffic(shape.buffer_numels, shape.world, shape.shards,
                               param_bytes=shape.bpp.params, grad_bytes=shape.bpp.grads,
                               algorithm=algorithm, muon_matrix_numel=muon_matrix_numel,
                               update_bytes=update_bytes)
    tiers = tier_traffic(shape)
    return Traffic(colls, tiers.device_to_host, tiers.host_to_device)


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
