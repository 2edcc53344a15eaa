"""Checks that need the world size: nodes (`comm.node_size`) and ZeRO++'s groups.

The config alone does not know how many ranks run; the launcher and the engine do, and
both call `check_nodes`, so a problem reads the same wherever it is found.
"""

from __future__ import annotations

from typing import Any

from zerotrain.config.base import ConfigError


def node_problems(cfg: Any, world: int) -> list[str]:
    """One message per problem with `comm.node_size` and `zero.secondary_partition`
    at `world` ranks, each naming the field to change."""
    out = []
    node = cfg.comm.node_size or world
    if world % node:
        out.append(f"comm.node_size ({node}) must divide the world size ({world}): set it to "
                   f"the ranks per node, a divisor of {world}")
        node = world
    k = cfg.zero.secondary_partition
    problem = secondary_partition_problem(k, node, world) if k else None
    if problem:
        out.append(problem)
    moe = getattr(cfg.model, "moe", None)
    if moe is not None and world % moe.expert_parallel:
        out.append(f"model.moe.expert_parallel ({moe.expert_parallel}) must divide the world "
                   f"size ({world}): use a divisor of {world}, or run on a multiple of "
                   f"{moe.expert_parallel} ranks")
    return out


def secondary_partition_problem(k: int, node: int, world: int) -> str | None:
    """Why hpZ's groups of `k` ranks cannot be cut from nodes of `node` ranks, or None
    (the launcher's check above and the strategy's own, zero/params/hpz.py)."""
    if node % k or world % k:
        return (f"zero.secondary_partition ({k}) must divide comm.node_size ({node}): hpZ "
                f"keeps a copy per group of K ranks inside a node; use a divisor of {node}")
    return None


def check_nodes(cfg: Any, world: int) -> None:
    problems = node_problems(cfg, world)
    if problems:
        raise ConfigError("\n".join(problems))
