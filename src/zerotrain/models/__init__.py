"""Models, and the plan beside each: which modules are ZeRO-3 units, which optimizer
group each parameter belongs to.

`plan_for(model)` returns the plan a model family registered in `PLANS`, or
`default_plan(model)` for any other `nn.Module`. The sizes the memory estimator needs
(`count_params`, `unit_numels`) come from the same plan, counted on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain.config import ModelConfig
from zerotrain.models import gpt
from zerotrain.models.plan import Group, Plan, default_plan, unit_members

#: model class -> its plan function (written beside the model)
PLANS: dict[type, Callable[[nn.Module], Plan]] = {gpt.GPT: gpt.plan}


def plan_for(model: nn.Module) -> Plan:
    fn = PLANS.get(type(model))
    return fn(model) if fn is not None else default_plan(model)


def on_meta(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """The model itself, or the factory's model built on the meta device (shapes only:
    a 70B model costs no memory to count)."""
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    with torch.device("meta"):
        return model_or_factory()


def count_params(model_or_factory: nn.Module | Callable[[], nn.Module]) -> int:
    """Unique parameter elements; tied weights count once (parameters() de-duplicates)."""
    return sum(p.numel() for p in on_meta(model_or_factory).parameters())


def unit_numels(model_or_factory: nn.Module | Callable[[], nn.Module]) -> dict[str, int]:
    """Elements per ZeRO-3 unit, by the very rule ZeRO-3 cuts with (`unit_members`).

    ZeRO-3 materialises one unit at a time, so the largest sets the transient memory.
    """
    model = on_meta(model_or_factory)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {name: sum(t[1].numel() for t in ps)
            for name, ps, _ in unit_members(model, plan_for(model), named)}


def model_size(model_cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, largest ZeRO-3 unit) of the model a config describes."""
    model = on_meta(lambda: gpt.GPT(model_cfg))
    return count_params(model), max(unit_numels(model).values(), default=0)


__all__ = ["PLANS", "Group", "Plan", "count_params", "default_plan", "model_size", "on_meta",
           "plan_for", "unit_numels"]
