"""Model-state bytes per rank (docs/design.md §zero): the formulas of the ZeRO table.

Arithmetic on element counts and bytes per element only: no model, no optimizer class
(their sizes and K come in as numbers). Padding is explicit: a flat buffer of P elements
partitioned over N ranks is padded to N·ceil(P/N), and each rank owns
`shard_numel(P, N) = ceil(P/N)` of it. "bytes" are per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zerotrain.config.run import OFFLOAD_RULE, OFFLOAD_STAGES

#: the model states (SPEC §6), the names strategies declare in `shards` / `offloads`
FIELDS = ("params", "grads", "master", "optimizer")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
#: SPEC §6's table: which states each ZeRO stage keeps 1/N per rank. The strategies
#: declare the same (tests/test_run_shape.py holds them equal); this serves the
#: stage-number API (`model_state_bytes`, the estimate's rows) that has no strategy.
STAGE_SHARDS: dict[int, frozenset[str]] = {
    0: frozenset(), 1: frozenset({"master", "optimizer"}),
    2: frozenset({"grads", "master", "optimizer"}), 3: frozenset(FIELDS),
}
#: what Offload moves to the host: the sharded states the optimizer reads and writes
OFFLOADED = frozenset({"grads", "master", "optimizer"})


def can_offload(shards: frozenset[str]) -> bool:
    """Whether a strategy sharding `shards` may offload: the stages of `OFFLOAD_STAGES`
    (config/run.py, where the rule is stated once)."""
    return any(shards == STAGE_SHARDS[s] for s in OFFLOAD_STAGES)

# ----------------------------------------------------------------------------- bytes/param


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter for each model state (optimizer = K_opt, master separate)."""

    params: int
    grads: int
    master: int
    optimizer: int


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


def bytes_per_param(precision: str = "bf16", optim_bytes: int = 8, *,
                    grad_dtype: str = "compute") -> BytesPerParam:
    """`optim_bytes`: the optimizer's K (`zerotrain.optim.state_bytes_per_param`)."""
    p, g, m = precision_bytes(precision, grad_dtype)
    return BytesPerParam(p, g, m, optim_bytes)


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
    gathered: int = 0
    activations: int = 0
    padding_elems: int = 0

    @property
    def device_total(self) -> int:
        return sum(self.device.values()) + self.gathered + self.activations

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

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
                pad_full: bool = False) -> MemoryEstimate:
    """Per-rank model-state bytes when a strategy that shards `shards` and offloads
    `offloads` partitions these flat buffers.

    Partitioned states cost ceil(P/N) per buffer; replicated ones cost P (or the padded
    N·ceil(P/N) with `pad_full`, for engines that keep full buffers padded). Offload moves
    the grad, master and optimizer shards to the host; if there is no master copy
    (fp32 / bf16-pure) the CPU optimizer still needs its own param shard, counted as master.
    """
    if offloads and not can_offload(shards):
        raise ValueError(OFFLOAD_RULE)
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
        est.device[f] = per[f] * (shard if f in shards else rep)
    if offloads:
        if bpp.master == 0:
            est.device["master"] = bpp.params * shard
        for f in sorted(offloads):
            est.host[f], est.device[f] = est.device[f], 0
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
def muon_state_bytes(matrix_numel: int, other_numel: int, world_size: int, stage: int,
                     owned_numel: int | None = None) -> int:
    """Per-rank Muon optimizer state: 4 B per element of the matrices this rank updates
    (all of them at stage 0; above, those it owns — `owned_numel`, or the mean Ψ_mat/N
    that ownership balanced by Newton–Schulz cost approaches) plus 8 B per element of the
    other tensors (replicated at stage 0, 1/N above)."""
    if stage == 0:
        return 4 * matrix_numel + 8 * other_numel
    owned = shard_numel(matrix_numel, world_size) if owned_numel is None else owned_numel
    return 4 * owned + 8 * shard_numel(other_numel, world_size)
