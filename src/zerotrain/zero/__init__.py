"""Units, gradients and one Strategy per ZeRO stage, composed from parts chosen once.

`build_strategy` is the one place where other subsystems' facts (the optimizer's rule,
pretrained weights coming, FP8 gathering) become parts: the stage class (what it shards,
`STRATEGIES`), a `Partition`, an updater (zero/update.py), where first values come from
(zero/init.py) and the parameters' wire (zero/wire.py). The strategy never sees a flag.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.comm.collectives import Comm
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.base import Strategy
from zerotrain.zero.build import build_units, make_grads
from zerotrain.zero.cut import run_shape
from zerotrain.zero.ddp import DDP
from zerotrain.zero.infinity import ParamTier, Streamed, TierGrads, Tiers
from zerotrain.zero.init import InitValues
from zerotrain.zero.muon import MatrixOwners
from zerotrain.zero.offload import ZeRO2Offload, ZeRO3Offload
from zerotrain.zero.partition import Partition
from zerotrain.zero.tier import make_tier
from zerotrain.zero.update import Elementwise, PerParameter, UnitByUnit, Updater
from zerotrain.zero.wire import Fp8Gather, PlainWire
from zerotrain.zero.zero1 import ZeRO1
from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3

STRATEGIES: dict[tuple[int, bool], type[Strategy]] = {
    (0, False): DDP, (1, False): ZeRO1, (2, False): ZeRO2, (3, False): ZeRO3,
    (2, True): ZeRO2Offload, (3, True): ZeRO3Offload,
}


def strategy_class(cfg: ZeroConfig) -> type[Strategy]:
    return STRATEGIES[(cfg.stage, cfg.offload_optimizer != "none")]


def make_tiers(cfg: ZeroConfig, device: torch.device, rank: int, elementwise: bool
               ) -> Tiers | None:
    """ZeRO-Infinity's parts (zero/infinity.py): where parameter shards live between uses
    and where the optimizer's states are streamed from; one NVMe tier serves both."""
    if cfg.offload_param == "none" and cfg.offload_optimizer != "nvme":
        return None
    if cfg.offload_optimizer == "nvme" and not elementwise:
        raise ValueError("zero.offload_optimizer nvme streams elementwise optimizer states "
                         "unit by unit; Muon updates whole matrices: use offload_optimizer "
                         "cpu or none with Muon")
    nvme = None
    if "nvme" in (cfg.offload_param, cfg.offload_optimizer):
        nvme = make_tier("nvme", device, path=cfg.nvme_path, threads=cfg.nvme_threads,
                         block_mb=cfg.nvme_block_mb, direct=cfg.nvme_direct, rank=rank)
    ptier = None
    if cfg.offload_param != "none":
        ptier = ParamTier(nvme if cfg.offload_param == "nvme" else make_tier("cpu", device),
                          cfg.offload_prefetch)
    return Tiers(ptier, nvme if cfg.offload_optimizer == "nvme" else None)


def choose_updater(cls: type[Strategy], elementwise: bool, device: torch.device
                   ) -> type[Updater]:
    """A non-elementwise rule (Muon) needs whole matrices: owners when the stage shards
    the optimizer, else full-shape tensors; Offload on a GPU steps unit by unit."""
    sharded = "optimizer" in cls.shards
    if not elementwise:
        return MatrixOwners if sharded else PerParameter
    return UnitByUnit if cls.offloads and device.type == "cuda" else Elementwise


def build_strategy(model: nn.Module, plan: Plan, policy: PrecisionPolicy, comm: Comm,
                   cfg: ZeroConfig, device: torch.device, *, elementwise: bool = True,
                   pretrained: bool = False, fp8_gather: bool = False) -> Strategy:
    """The strategy of `cfg` over every rank of `comm`. `elementwise`: the optimizer's rule
    may run on flat runs (all but Muon); `pretrained`: weights are loaded next (meta
    units are not initialised); `fp8_gather`: ZeRO-3 gathers the plan's FP8 weights in
    one byte per element."""
    cls = strategy_class(cfg)
    tiers = make_tiers(cfg, device, comm.rank, elementwise)  # the config allows them at stage 3
    wire = PlainWire()
    if fp8_gather and "params" in cls.shards:
        wire = Fp8Gather(frozenset(f"{m}.weight" for m in plan.fp8_linears))
    part = Partition.of(comm)
    grads = make_grads(cls, policy, device, cfg.in_flight(device.type))
    if tiers is not None and tiers.opt is not None and device.type == "cpu":
        grads = TierGrads(policy.grad_dtype, device, grads.host,
                          **cls.grads_options(policy, cfg.in_flight(device.type)),
                          tier=tiers.opt, depth=cfg.offload_prefetch)
    units = build_units(cls, model, plan, policy, part, cfg, device,
                        InitValues(model, plan, skip=pretrained), grads, tiers)
    streamed = tiers is not None and tiers.opt is not None
    updater = Streamed if streamed else choose_updater(cls, elementwise, device)
    extra = {"tiers": tiers} if tiers is not None else {}
    return cls(model, plan, policy, part, cfg, device, units, grads, updater=updater,
               wire=wire, **extra)


__all__ = ["DDP", "STRATEGIES", "Partition", "Strategy", "ZeRO1", "ZeRO2", "ZeRO2Offload",
           "ZeRO3", "ZeRO3Offload", "build_strategy", "choose_updater", "run_shape",
           "strategy_class"]
