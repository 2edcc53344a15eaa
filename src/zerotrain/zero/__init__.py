"""Units, gradients and one Strategy per ZeRO stage; the config picks the class."""

from __future__ import annotations

from zerotrain.config import ZeroConfig
from zerotrain.zero.base import Strategy
from zerotrain.zero.ddp import DDP
from zerotrain.zero.offload import ZeRO2Offload, ZeRO3Offload
from zerotrain.zero.zero1 import ZeRO1
from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3

STRATEGIES: dict[tuple[int, bool], type[Strategy]] = {
    (0, False): DDP, (1, False): ZeRO1, (2, False): ZeRO2, (3, False): ZeRO3,
    (2, True): ZeRO2Offload, (3, True): ZeRO3Offload,
}


def strategy_class(cfg: ZeroConfig) -> type[Strategy]:
    return STRATEGIES[(cfg.stage, cfg.offload_optimizer != "none")]


__all__ = ["DDP", "STRATEGIES", "Strategy", "ZeRO1", "ZeRO2", "ZeRO2Offload", "ZeRO3",
           "ZeRO3Offload", "strategy_class"]
