"""What expert parallelism (`model.moe.expert_parallel` P) changes per rank, by formula
(layout and collectives: models/moe_parallel.py, zero/experts.py).

Of Ψ parameters, Ψ_e are experts. At W = D·P ranks each rank holds Ψ_e/P of them; ZeRO
shards those over the D ranks of its expert-data-parallel group, so a sharded state
(stage ≥ 1) stays Ψ_e/W per rank — as without EP — while everything held whole (the
parameters at stages 0–2, one gathered unit at ZeRO-3) shrinks P-fold, and so do
ZeRO-3's expert gathers: (D−1)/D·Ψ_e/P elements per gather instead of (W−1)/W·Ψ_e.
The price is the all-to-all: per MoE layer and micro-step a rank sends each of its
T·k (token, expert) pairs that leaves its rank — (P−1)/P of them under uniform routing
— twice (there and back) forward and twice backward, d elements each, plus its counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ExpertShape:
    params: int          # Ψ: every parameter of the model
    expert_params: int   # Ψ_e: the experts' (every layer, every expert)
    layers: int          # MoE layers
    experts: int         # E per layer
    top_k: int
    hidden: int          # d: one pair's row on the wire
    parallel: int        # P
    world: int           # W


def expert_rows(s: ExpertShape, tokens: int, act_bytes: int, param_bytes: int,
                micro_steps: int = 1) -> dict:
    """Per rank and optimizer step: the experts held and sharded, ZeRO-3's parameter
    gather bytes with and without EP, and the all-to-all's bytes (uniform routing),
    for `tokens` tokens per rank per micro-step."""
    P, W = s.parallel, s.world
    D = W // P
    dense = s.params - s.expert_params
    held = s.expert_params // P
    pairs_out = tokens * s.top_k * (P - 1) / P  # pairs that leave the rank, per layer
    rows = 4 * pairs_out * s.hidden * act_bytes + (s.experts - s.experts // P) * 8
    a2a = int(s.layers * rows * micro_steps)
    gathers = 2 * micro_steps  # forward and backward
    z3 = gathers * param_bytes * ((W - 1) / W * dense + (D - 1) / D * held)
    z3_ep1 = gathers * param_bytes * (W - 1) / W * s.params
    return {**asdict(s), "edp": D, "experts_held_per_rank": held,
            "expert_shard_per_rank": -(-held // D), "experts_held_ep1": s.expert_params,
            "zero3_param_bytes": int(z3), "zero3_param_bytes_ep1": int(z3_ep1),
            "all_to_all_bytes": a2a}


def expert_lines(r: dict) -> list[str]:
    """The estimate's lines about expert parallelism."""
    P, D = r["parallel"], r["edp"]
    return [
        f"expert parallel {P} (EP groups of {P} consecutive ranks, experts sharded over "
        f"the {D} ranks holding the same ones): experts {r['expert_params']:,} of "
        f"{r['params']:,} params",
        f"  experts held per rank {r['experts_held_per_rank']:,} (EP 1: "
        f"{r['experts_held_ep1']:,}); sharded by ZeRO: {r['expert_shard_per_rank']:,} "
        f"per rank (as at EP 1: the rows above)",
        f"  ZeRO-3 parameter all-gathers {r['zero3_param_bytes'] / 1e6:,.1f} MB/step per "
        f"rank (EP 1: {r['zero3_param_bytes_ep1'] / 1e6:,.1f} MB, "
        f"x{r['zero3_param_bytes'] / max(1, r['zero3_param_bytes_ep1']):.2f}); "
        f"all-to-all {r['all_to_all_bytes'] / 1e6:,.1f} MB/step (uniform routing)",
        f"  the memory rows above are for EP 1: where a stage holds parameters (or "
        f"gradients) whole, each rank holds {P}x fewer experts than they say; ZeRO-3 "
        f"gathers {P}x smaller expert units",
    ]
