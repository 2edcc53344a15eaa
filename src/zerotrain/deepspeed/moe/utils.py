"""`deepspeed.moe.utils` for scripts that import it (CIFAR-10 of DeepSpeedExamples builds
its groups with `split_params_into_different_moe_groups_for_optimizer`). zerotrain runs
no MoE layers, so no parameter is an expert parameter and the groups pass through."""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed marks expert parameters with `allreduce=False`; nothing here sets it."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Any, max_group_size: int | None = 178956971) -> list[dict[str, Any]]:
    """The groups as a list (a dict becomes a one-group list, a tuple a list, as
    DeepSpeed returns them); an expert (MoE) parameter, which zerotrain cannot hold, is
    refused."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for g in groups:
        if any(is_moe_param(p) for p in g["params"]):
            raise ValueError("an expert (MoE) parameter is in the param groups: DeepSpeed MoE "
                             "layers are not supported by zerotrain")
    return groups


def split_params_grads_into_shared_and_expert_params(group: list) -> tuple[list, list]:
    """(shared, expert) gradients: every one is shared here."""
    return [p for p in group if p.grad is not None], []
