"""The pieces of `deepspeed.runtime` (and `deepspeed.checkpoint.utils`) that scripts and
the Hugging Face libraries import: `move_to_device`, `clone_tensors_for_torch_save`,
`VALID_LR_SCHEDULES`, `ZeroParamStatus`. `zerotrain launch` and `zerotrain.hf` answer
`deepspeed.runtime.utils`, `deepspeed.runtime.lr_schedules` and
`deepspeed.checkpoint.utils` with this module (zerotrain/hf/alias.py)."""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.deepspeed.engine import DeepSpeedEngine
from zerotrain.deepspeed.zero import ZeroParamStatus

__all__ = ["VALID_LR_SCHEDULES", "DeepSpeedEngine", "ZeroParamStatus",
           "clone_tensors_for_torch_save", "move_to_device"]

#: DeepSpeed's scheduler names (Accelerate hands a scheduler of these types to initialize)
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                      "WarmupCosineLR"]


def move_to_device(item: Any, device: Any, criterion_func: Any = None) -> Any:
    """Tensors in nested lists, tuples and dicts moved to `device` (those for which
    `criterion_func(t)` is true, when given); everything else as it is."""
    if isinstance(item, torch.Tensor):
        if criterion_func is None or criterion_func(item):
            return item.to(device)
        return item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of `item` whose tensors are detached clones on `device` (so torch.save
    writes each tensor's own values, not the storage it views)."""
    if isinstance(item, torch.Tensor):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
