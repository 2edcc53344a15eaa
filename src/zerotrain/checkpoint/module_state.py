"""What a checkpoint keeps of a rank beside the model states: its random streams, the
module's non-parameter buffers, and the names tied weights go by."""

from __future__ import annotations

import torch
from torch import nn


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent non-parameter state (e.g. running statistics), as state_dict names it."""
    param_ids = {id(p) for p in module.parameters()}
    return {name: b for name, b in module.state_dict(keep_vars=True).items()
            if id(b) not in param_ids and isinstance(b, torch.Tensor)}


def aliases(module: nn.Module) -> dict[str, str]:
    """state_dict name -> canonical parameter name (tied weights share one canonical)."""
    canon: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), name)
        out[name] = canon[id(p)]
    return out
