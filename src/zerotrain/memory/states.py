"""Model-state bytes per rank (docs/design.md §zero): the formulas of the ZeRO table.

Arithmetic on element counts and bytes per element only: no model, no optimizer class
(their sizes and K come in as numbers). Padding is explicit: a flat buffer of P elements
partitioned over N ranks is padded to N·ceil(P/N), and each rank owns
`shard_numel(P, N) = ceil(P/N)` of it. "bytes" are per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zerotrain.config.zero_facts import (
    FIELDS,
    OFFLOAD_RULE,
    OFFLOAD_STAGES,
    OFFLOADED,
    STAGE_SHARDS,
)

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
#: where a model state can live: device memory, host memory, files on a disk (NVMe)
TIERS = ("device", "host", "disk")


def can_offload(shards: frozenset[str]) -> bool:
    """Whether a strategy sharding `shards` may offload: the stages of `OFFLOAD_STAGES`
    (config/run.py, where the rule is stated once)."""
    return any(shards == STAGE_SHARDS[s] for s in OFFLOAD_STAGES)


def offload_problem(shards: frozenset[str], offloads: frozenset[str],
                    disk: frozenset[str] = frozenset()) -> str | None:
    """Why a strategy sharding `shards` cannot keep `offloads` off the device (`disk` of
    them on disk), or None. Read from the declarations: the optimizer's states need the
    gradient shard (`can_offload`); parameters, and anything on disk, need the parameter
    shard (ZeRO-3, where each unit is fetched for its use)."""
    if offloads & OFFLOADED and not can_offload(shards):
        return OFFLOAD_RULE
    if "params" in offloads and "params" not in shards:
        return "parameters are offloaded only where they are sharded (stage 3)"
    if disk and "params" not in shards:
        return "a disk tier needs the parameters sharded (stage 3): each unit is streamed"
    if not disk <= offloads:
        return "states on disk must be declared offloaded too"
    return None


def declared_offloads(offload_optimizer: str = "none", offload_param: str = "none", *,
                      host_is_device: bool = False) -> tuple[frozenset[str], frozenset[str]]:
    """(offloads, disk) of the config's tiers (zero.offload_optimizer / offload_param:
    none, cpu or nvme). The optimizer's tier holds the master and the moments; beside a
    GPU its gradient shard stays in host memory with nvme (it is written every
    micro-step and read once by the update, so it is kept where the update runs).
    `host_is_device` (a CPU-only run): host memory is the memory being saved, so there
    the gradient shard goes to the disk with the optimizer (zero/states/disk.TierGrads),
    and a `cpu` parameter tier is the device itself — nothing moves."""
    for name, v in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if v not in ("none", "cpu", "nvme"):
            raise ValueError(f"{name} must be none, cpu or nvme, got {v!r}")
    offloads = set(OFFLOADED) if offload_optimizer != "none" else set()
    disk = {"master", "optimizer"} if offload_optimizer == "nvme" else set()
    if host_is_device and offload_optimizer == "nvme":
        disk.add("grads")
    if offload_param == "nvme" or (offload_param == "cpu" and not host_is_device):
        offloads.add("params")
    if offload_param == "nvme":
        disk.add("params")
    return frozenset(offloads), frozenset(disk)


def tier_of(state: str, offloads: frozenset[str], disk: frozenset[str]) -> str:
    """The tier a model state lives in between uses."""
    return "disk" if state in disk else "host" if state in offloads else "device"

# ----------------------------------------------------------------------------- bytes/param


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter for each model state (optimizer = K_opt, master separate)."""

    params: int
    grads: int
    master: int
    optimizer: float  # int8 states: 1 + 4/256 per state (block scales), so fractional
    comp: int = 0  # bf16 masters with Kahan: the compensation (2), counted as master

def precision_bytes(precision: str, grad_dtype: str = "compute") -> tuple[int, int, int]:
    """(param, grad, master) bytes: fp32 params are their own master; mixed keeps a fp32 one."""
    if precision == "fp32":
        return 4, 4, 0
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    if grad_dtype not in ("compute", "fp32"):
        raise ValueError(f"unknown grad dtype '{grad_dtype}'; choose compute or fp32")
    grad = 4 if grad_dtype == "fp32" else 2
    return 2, grad, 0 if precision == "bf16-pure" else 4


def bytes_per_param(precision: str = "bf16", optim_bytes: float = 8, *,
                    grad_dtype: str = "compute", master_dtype: str | None = None,
                    master_update: str | None = None) -> BytesPerParam:
    """`optim_bytes`: the optimizer's K (`zerotrain.optim.state_bytes_per_param`).
    `master_dtype` bf16: the bf16 parameters are the masters (no copy), and Kahan
    (`master_update`) adds a 2-byte compensation."""
    p, g, m = precision_bytes(precision, grad_dtype)
    if master_dtype == "bf16":
        m = 0
    return BytesPerParam(p, g, m, optim_bytes, comp=2 if master_update == "kahan" else 0)


def activation_dtype_bytes(precision: str) -> int:
    """The engine casts the model to the compute dtype (no autocast): every activation has it."""
    return 4 if precision == "fp32" else 2


# ----------------------------------------------------------------------------- model states


def shard_numel(numel: int, world: int) -> int:
    """Elements one rank owns of a P-element buffer padded to a multiple of N."""
    return -(-numel // world)


@dataclass
class MemoryEstimate:
    """Bytes on one rank. device/host keys: params, grads, master, optimizer.

    `gathered` is ZeRO-3's transient full copy of the largest unit (param dtype);
    `activations` is whatever the caller adds; `padding_elems` is how many padding
    elements the partitioned buffers hold in total (N·ceil(P/N) − P summed), so an audit
    of padded full-size flat buffers can add `padding_elems × bytes`.
    Transient gradient buckets (before reduce-scatter / the copy to host) are not counted.
    """

    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    host: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    disk: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))
    gathered: int = 0
    activations: int = 0
    padding_elems: int = 0
    #: read/write buffers of the offload tiers per memory tier (memory/tiers.py)
    staging: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})

    @property
    def device_total(self) -> int:
        return (sum(self.device.values()) + self.gathered + self.activations
                + self.staging["device"])

    @property
    def host_total(self) -> int:
        return sum(self.host.values()) + self.staging["host"]

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())

    @property
    def total(self) -> int:
        return self.device_total + self.host_total


def model_state_bytes_from_buffers(
    buffer_numels: Sequence[int], world_size: int, stage: int, *, param_bytes: int,
    grad_bytes: int, master_bytes: int, optim_bytes: int, offload: bool = False,
    largest_unit: int = 0, pad_full: bool = False,
) -> MemoryEstimate:
    """`state_bytes` by stage number (SPEC §6's table)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in STAGE_SHARDS:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    return state_bytes(buffer_numels, world_size, STAGE_SHARDS[stage],
                       OFFLOADED if offload else frozenset(),
                       BytesPerParam(param_bytes, grad_bytes, master_bytes, optim_bytes),
                       largest_unit=largest_unit, pad_full=pad_full)


def state_bytes(buffer_numels: Sequence[int], world_size: int, shards: frozenset[str],
                offloads: frozenset[str], bpp: BytesPerParam, *, largest_unit: int = 0,
                pad_full: bool = False, disk: frozenset[str] = frozenset()
                ) -> MemoryEstimate:
    """Per-rank model-state bytes when a strategy that shards `shards` and offloads
    `offloads` (`disk` of them to disk, the rest to the host) partitions these buffers.

    Partitioned states cost ceil(P/N) per buffer; replicated ones cost P (or the padded
    N·ceil(P/N) with `pad_full`, for engines that keep full buffers padded). Each state
    is counted in its tier (`tier_of`). If there is no master copy (fp32 / bf16-pure)
    and the optimizer lives in another tier than the parameters, it keeps its own copy
    of the parameter shard there, counted as master; in the same tier the parameter
    shard is the master.
    """
    why = offload_problem(shards, offloads, disk)
    if why is not None:
        raise ValueError(why)
    if any(n < 0 for n in buffer_numels):
        raise ValueError("buffer sizes must be >= 0")
    n = world_size
    full = sum(buffer_numels)
    shard = sum(shard_numel(p, n) for p in buffer_numels)
    padding = n * shard - full
    rep = n * shard if pad_full else full
    per = {"params": bpp.params, "grads": bpp.grads, "master": bpp.master,
           "optimizer": bpp.optimizer}
    est = MemoryEstimate(padding_elems=padding if shards else 0)
    for f in FIELDS:
        est.device[f] = math.ceil(per[f] * (shard if f in shards else rep))
    if bpp.master == 0 and tier_of("params", offloads, disk) != tier_of("optimizer", offloads,
                                                                          disk):
        est.device["master"] = bpp.params * shard
    est.device["master"] += bpp.comp * (shard if "master" in shards else rep)
    for f in sorted(offloads):
        where = est.disk if f in disk else est.host
        where[f], est.device[f] = est.device[f], 0
    if "params" in shards:
        est.gathered = largest_unit * bpp.params
    return est


def model_state_bytes(
    psi: int, world_size: int, stage: int, *, param_bytes: int, grad_bytes: int,
    master_bytes: int, optim_bytes: int, offload: bool = False, largest_unit: int = 0,
) -> MemoryEstimate:
    """SPEC §6 table for Ψ elements in one flat buffer (padded to a multiple of N)."""
    return model_state_bytes_from_buffers(
        [psi], world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
        master_bytes=master_bytes, optim_bytes=optim_bytes, offload=offload,
        largest_unit=largest_unit,
    )


def estimate(psi: int, world_size: int, stage: int, *, precision: str = "bf16",
             optim_bytes: int = 8, grad_dtype: str = "compute", offload: bool = False,
             largest_unit: int = 0, activations: int = 0) -> MemoryEstimate:
    """`model_state_bytes` with the param/grad/master bytes looked up from the precision."""
    bpp = bytes_per_param(precision, optim_bytes, grad_dtype=grad_dtype)
    est = model_state_bytes(
        psi, world_size, stage, param_bytes=bpp.params, grad_bytes=bpp.grads,
        master_bytes=bpp.master, optim_bytes=bpp.optimizer, offload=offload,
        largest_unit=largest_unit,
    )
    est.activations = activations
    return est


# ----------------------------------------------------------------------------- inverse


def max_params(fits: Callable[[int], bool], hi: int = 1 << 20) -> int | None:
    """Largest Ψ with fits(Ψ) (None if not even Ψ = 0 fits), by bisection on a monotone
    predicate: padding makes the forward formula a step function, and bisecting the forward
    formula itself keeps the two answers consistent by construction."""
    if not fits(0):
        return None
    while fits(hi):
        hi *= 2
        if hi > 1 << 62:
            raise ValueError("memory limit too large to bound")
    lo = 0  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# Distributed Muon (zero/muon.py, stages 1–3): each matrix is owned whole by one rank.
def muon_state_bytes(matrix_numel: int, other_numel: int, world_size: int,
                     stage: int | None = None, owned_numel: int | None = None, *,
                     sharded: bool | None = None) -> int:
    """Per-rank Muon optimizer state: 4 B per element of the matrices this rank updates
    (all of them when the optimizer is not sharded, stage 0; when it is, those it owns —
    `owned_numel`, or the mean Ψ_mat/N that ownership balanced by Newton–Schulz cost
    approaches) plus 8 B per element of the other tensors (replicated, or 1/N).
    `sharded` (the strategy's declaration) or, by number, `stage` > 0."""
    if sharded is None:
        if stage is None:
            raise ValueError("give sharded (or a stage number)")
        sharded = stage != 0
    if not sharded:
        return 4 * matrix_numel + 8 * other_numel
    owned = shard_numel(matrix_numel, world_size) if owned_numel is None else owned_numel
    return 4 * owned + 8 * shard_numel(other_numel, world_size)
