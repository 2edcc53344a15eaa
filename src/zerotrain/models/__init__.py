"""Models, and the plan beside each: which modules are ZeRO-3 units, which optimizer
group each parameter belongs to.

`plan_for(model)` returns the plan a model family registered in `PLANS`, or
`default_plan(model)` for any other `nn.Module`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from zerotrain.models import gpt
from zerotrain.models.plan import Group, Plan, default_plan

#: model class -> its plan function (written beside the model)
PLANS: dict[type, Callable[[nn.Module], Plan]] = {gpt.GPT: gpt.plan}


def plan_for(model: nn.Module) -> Plan:
    fn = PLANS.get(type(model))
    return fn(model) if fn is not None else default_plan(model)


__all__ = ["PLANS", "Group", "Plan", "default_plan", "plan_for"]
