"""Units, gradients and one Strategy per ZeRO stage, composed from parts chosen once.

`build_strategy` is the one place where other subsystems' facts (the optimizer's rule,
pretrained weights coming, FP8 gathering, offload) become parts: the stage class (what it
shards, `STAGES`), a placement (where gradients, masters and optimizer states live:
zero/states/home.py, `PLACEMENTS`), a `Partition`, an updater (zero/update.py), where first
values come from (zero/init.py) and the parameters' wire (zero/params/wire.py). The strategy
never sees a flag.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.comm.collectives import Comm
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero import experts
from zerotrain.zero.base import Strategy
from zerotrain.zero.build import build_units
from zerotrain.zero.cut import run_shape
from zerotrain.zero.ddp import DDP
from zerotrain.zero.init import InitValues
from zerotrain.zero.muon import MatrixOwners
from zerotrain.zero.params.tiered import ParamTier
from zerotrain.zero.params.wire import choose_wire
from zerotrain.zero.partition import Partition
from zerotrain.zero.state import WeightReader
from zerotrain.zero.states.disk import NvmeOffload, Tiers
from zerotrain.zero.states.grad_wire import choose_grad_wire
from zerotrain.zero.states.home import Kind, OnDevice, Placement
from zerotrain.zero.states.host import HostOffload
from zerotrain.zero.tiers.lazy import Lazy, swap_lazy
from zerotrain.zero.tiers.tier import make_tier
from zerotrain.zero.update import Elementwise, PerParameter, UnitByUnit, Updater
from zerotrain.zero.zero1 import ZeRO1
from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3

STAGES: dict[int, type[Strategy]] = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
#: by `zero.offload_optimizer` (nvme: ZeRO-Infinity's, streaming what ZeRO-Offload keeps
#: in host memory)
PLACEMENTS: dict[str, type[Placement]] = {"none": OnDevice, "cpu": HostOffload,
                                          "nvme": NvmeOffload}


def strategy_class(cfg: ZeroConfig) -> Kind:
    """The stage class and the placement of `cfg`."""
    return Kind(STAGES[cfg.stage], PLACEMENTS[cfg.offload_optimizer])


def make_tiers(cfg: ZeroConfig, device: torch.device, rank: int, elementwise: bool
               ) -> Tiers | None:
    """ZeRO-Infinity's parts (zero/states/disk.py): where parameter shards live between uses
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




def choose_updater(kind: Kind, elementwise: bool, placement: Placement) -> type[Updater]:
    """A non-elementwise rule (Muon) needs whole matrices: owners when the stage shards
    the optimizer, else full-shape tensors; Offload on a GPU steps unit by unit."""
    sharded = "optimizer" in kind.shards
    if not elementwise:
        return MatrixOwners if sharded else PerParameter
    return UnitByUnit if placement.steps_by_unit else Elementwise


def build_strategy(model: nn.Module, plan: Plan, policy: PrecisionPolicy, comm: Comm,
                   cfg: ZeroConfig, device: torch.device, *, elementwise: bool = True,
                   pretrained: bool = False, fp8_gather: bool = False) -> Strategy:
    """The strategy of `cfg` over every rank of `comm`. `elementwise`: the optimizer's rule
    may run on flat runs (all but Muon); `pretrained`: weights are loaded next (meta
    units are not initialised); `fp8_gather`: ZeRO-3 gathers the plan's FP8 weights in
    one byte per element."""
    kind = strategy_class(cfg)
    cls = kind.stage_class
    tiers = make_tiers(cfg, device, comm.rank, elementwise)  # the config allows them at stage 3
    placement = kind.placement.make(device, tiers, cfg.offload_prefetch)
    part = Partition.of(comm)
    expert_part = experts.setup(model, comm)  # expert parallelism's groups, or None
    grads = placement.make_grads(cls, policy, cfg.in_flight(device.type))
    units = build_units(cls, model, plan, policy, part, cfg, device,
                        InitValues(model, plan, skip=pretrained), placement, tiers,
                        expert_part)
    extra = {"param_tier": tiers.params} if tiers is not None else {}
    return cls(model, plan, policy, part, cfg, device, units, grads,
               updater=choose_updater(kind, elementwise, placement),
               wire=choose_wire(cls.shards, plan, cfg, fp8_gather=fp8_gather),
               grad_wire=choose_grad_wire(comm, cls.shards, cfg.grad_wire),
               placement=placement, **extra)

__all__ = [
    "DDP",
    "PLACEMENTS",
    "STAGES",
    "HostOffload",
    "Kind",
    "Lazy",
    "NvmeOffload",
    "OnDevice",
    "Partition",
    "Placement",
    "Strategy",
    "WeightReader",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "build_strategy",
    "choose_updater",
    "run_shape",
    "strategy_class",
    "swap_lazy",
]
