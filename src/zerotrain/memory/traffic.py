"""Bytes each rank sends per optimizer step (docs/design.md §ring, §zero), and the α–β
time they take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerotrain.memory.states import shard_numel

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


def traffic_per_step(psi: int | Sequence[int], world_size: int, stage: int, *,
                     param_bytes: int, grad_bytes: int, offload: bool = False,
                     algorithm: str = "ring") -> Traffic:
    """SPEC §6 traffic column: DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ (each ×(N−1)/N, in elements).

    ZeRO-1 does not all-reduce: reduce-scatter grads, then all-gather the updated params.
    Offload keeps the collectives of its stage and adds a grad shard down, param shard up.
    """
    if offload and stage < 2:
        raise ValueError("offload needs stage 2 or 3")
    n = world_size
    sizes = [psi] if isinstance(psi, int) else list(psi)
    if stage == 0:
        colls = [collective_cost("all_reduce", sizes, n, grad_bytes, algorithm=algorithm,
                                 what="grads")]
    else:
        gathers = ["params (fwd)", "params (bwd)"] if stage == 3 else ["params"]
        colls = [collective_cost("reduce_scatter", sizes, n, grad_bytes, what="grads")]
        colls += [collective_cost("all_gather", sizes, n, param_bytes, what=w) for w in gathers]
    t = Traffic(colls)
    if offload:
        shard = sum(shard_numel(p, n) for p in sizes)
        t.device_to_host_bytes = shard * grad_bytes
        t.host_to_device_bytes = shard * param_bytes
    return t


