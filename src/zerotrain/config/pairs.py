"""Options that cannot meet: one sentence per refused pair, naming both settings.

What one section cannot know alone — Muon with the disk tier, the FP8 wire without FP8
linears, ZeRO++'s node groups with sequence parallelism, Muon with fused experts — is
stated here once; the config's cross-checks refuse the first problem found, and the
combination matrix (tests/test_matrix.py, docs/matrix.md) lists the same pairs. A pair
that needs only a ZeRO stage is a row of `config/zero_facts.py` instead.
"""

from __future__ import annotations

from typing import Any


def pair_problems(cfg: Any) -> list[str]:
    """Every refused pair set in `cfg` (a `Config`), in a fixed order."""
    z, p, o, out = cfg.zero, cfg.precision, cfg.optimizer, []
    if o.name == "muon" and z.offload_optimizer == "nvme":
        out.append("optimizer.name muon with zero.offload_optimizer nvme: the disk tier "
                   "streams elementwise optimizer states unit by unit and Muon updates whole "
                   "matrices; use zero.offload_optimizer cpu or none with Muon")
    if z.param_wire == "fp8" and not p.fp8.enabled:
        out.append("zero.param_wire fp8 sends the FP8 linears' weights; it needs "
                   "precision.fp8.enabled true (or use zero.param_wire int8)")
    if p.fp8.all_gather and z.param_wire == "int8":
        out.append("precision.fp8.all_gather (= zero.param_wire fp8) and zero.param_wire int8 "
                   "are two wires for the same gather; pick one")
    zpp = [f for f, on in (("secondary_partition", z.secondary_partition),
                           ("grad_wire", z.grad_wire != "plain")) if on]
    if zpp and cfg.sequence.parallel > 1:
        out.append(f"zero.{zpp[0]} places groups by node over every rank; it does not combine "
                   "with sequence.parallel > 1 yet: remove one of them")
    if p.fp8.all_gather and z.stage != 3:
        out.append("precision.fp8.all_gather gathers ZeRO-3's sharded weights; it needs "
                   f"zero.stage 3 (got {z.stage})")
    ep = cfg.model.moe.expert_parallel if cfg.model.moe is not None else 1
    for on, what in ((z.secondary_partition, "zero.secondary_partition"),
                     (z.grad_wire != "plain", "zero.grad_wire"),
                     (p.fp8.all_gather or z.param_wire != "plain", "zero.param_wire"),
                     (cfg.sequence.parallel > 1, "sequence.parallel"),
                     (z.offload_param != "none" or z.offload_optimizer == "nvme",
                      "zero.offload_param / zero.offload_optimizer nvme")):
        if ep > 1 and on:
            out.append(f"{what} with model.moe.expert_parallel > 1 is not supported yet "
                       "(expert units are sharded over their own group): remove one of them")
            break
    if cfg.model.moe is not None and o.name == "muon":
        out.append("optimizer.name muon with model.moe: Muon would orthogonalise a layer's "
                   "fused experts [E, 2I, d] as one matrix, not expert by expert; use "
                   "optimizer.name adamw")
    return out
