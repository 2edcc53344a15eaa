"""`deepspeed.utils` as scripts and the Hugging Face libraries use it: the `logger`
(the Trainer sets its level), `log_dist`, and the `safe_*` accessors that read or write
one parameter whole, whatever the ZeRO stage (`safe_get_full_fp32_param` & co.).

The accessors are collectives at ZeRO-3 (every rank calls them, as in DeepSpeed): they
gather the engine's parameters for the read. Values: the fp32 parameter as the forward
sees it, which is the fp32 master weight in an fp32 run; in a bf16/fp16 run it is the
16-bit copy widened (DeepSpeed returns its fp32 master there).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from zerotrain.deepspeed import zero

__all__ = ["log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_fp32_param"]

logger = logging.getLogger("DeepSpeed")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the ranks listed (all when `ranks` is None or holds -1)."""
    from zerotrain.deepspeed.comm import get_rank

    if ranks is None or -1 in ranks or get_rank() in ranks:
        logger.log(level, f"[Rank {get_rank()}] {message}")


def _engine_of(param: Tensor) -> Any:
    engine = zero._owner([param])
    if engine is None:
        raise ValueError("safe_get/set_full_*: the parameter belongs to no zerotrain.deepspeed "
                         "engine (call it after deepspeed.initialize, with a parameter of "
                         "engine.module)")
    return engine


def _name_of(engine: Any, param: Tensor) -> str:
    for name, p in engine.module.named_parameters():
        if p is param:
            return name
    raise ValueError("the parameter is not one of the engine's")


def safe_get_full_fp32_param(param: Tensor) -> Tensor:
    """The whole parameter as fp32 (a copy)."""
    engine = _engine_of(param)
    with engine.full_parameters():
        return param.detach().float().clone()


def safe_set_full_fp32_param(param: Tensor, value: Tensor) -> None:
    """Set the whole parameter (and its fp32 master on every rank) to `value`."""
    engine = _engine_of(param)
    name = _name_of(engine, param)
    with engine.full_parameters():
        engine.write_weights({name: value.detach().to(torch.float32)})


def safe_get_full_grad(param: Tensor) -> Tensor | None:
    """The whole averaged gradient of the last backward, or None (zerotrain keeps only the
    reduced shards of a gradient between backward and step: not readable as a whole)."""
    raise NotImplementedError("safe_get_full_grad: zerotrain keeps gradients as reduced "
                              "shards inside the engine; not implemented")


def safe_get_full_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    raise NotImplementedError("safe_get_full_optimizer_state is not implemented by zerotrain")
