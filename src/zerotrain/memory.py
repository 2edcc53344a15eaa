"""The memory and traffic model (docs/design.md: ZeRO), as formulas, plus measurement.

Everything here is arithmetic on element counts and bytes per element: it knows no
model and no optimizer class (their sizes and K come in as numbers). The engine's
measured memory audit is held against these numbers, so padding is explicit: a flat
buffer of P elements that is partitioned over N ranks is padded to N·ceil(P/N), and each
rank owns `shard_numel(P, N) = ceil(P/N)` of it.

Conventions: "bytes" are per rank; GB = 10^9 bytes, GiB = 2^30 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from zerotrain.config import ModelConfig

FIELDS = ("params", "grads", "master", "optimizer")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")

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
    """Per-rank model-state bytes when the engine partitions these flat buffers.

    Partitioned states cost ceil(P/N) per buffer; replicated ones cost P (or the padded
    N·ceil(P/N) with `pad_full`, for engines that keep full buffers padded). Offload moves
    the grad, master and optimizer shards to the host; if there is no master copy
    (fp32 / bf16-pure) the CPU optimizer still needs its own param shard, counted as master.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload and stage < 2:
        raise ValueError("offload needs stage 2 or 3 (it offloads the sharded states)")
    if any(n < 0 for n in buffer_numels):
        raise ValueError("buffer sizes must be >= 0")
    n = world_size
    full = sum(buffer_numels)
    shard = sum(shard_numel(p, n) for p in buffer_numels)
    padding = n * shard - full
    rep = n * shard if pad_full else full
    sharded = {  # which states each stage partitions (SPEC §6)
        0: (), 1: ("master", "optimizer"), 2: ("grads", "master", "optimizer"),
        3: ("params", "grads", "master", "optimizer"),
    }[stage]
    per = {"params": param_bytes, "grads": grad_bytes, "master": master_bytes,
           "optimizer": optim_bytes}
    est = MemoryEstimate(padding_elems=padding if stage else 0)
    for f in FIELDS:
        est.device[f] = per[f] * (shard if f in sharded else rep)
    if offload:
        if master_bytes == 0:
            est.device["master"] = param_bytes * shard
        for f in ("grads", "master", "optimizer"):
            est.host[f], est.device[f] = est.device[f], 0
    if stage == 3:
        est.gathered = largest_unit * param_bytes
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


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class CollectiveCost:
    """What one rank sends for one kind of collective, and in how many message rounds.

    α–β time = rounds·α + sent_bytes/β: every round each rank sends one message on its
    own link, all links busy at once, so the slowest link is the step's time.
    """

    op: str
    what: str
    sent_numel: int
    sent_bytes: int
    rounds: int

    def time_s(self, bandwidth_gbps: float, latency_us: float) -> float:
        return self.rounds * latency_us * 1e-6 + self.sent_bytes / (bandwidth_gbps * 1e9)


def collective_cost(op: str, numels: int | Sequence[int], world: int, elem_bytes: int, *,
                    algorithm: str = "ring", what: str = "") -> CollectiveCost:
    """Ring: a reduce-scatter or all-gather is N−1 rounds of one ceil(P/N) chunk; all-reduce
    is both (2(N−1)/N·P). Naive all-reduce: each rank sends its whole buffer to each of the
    N−1 others, one after another on its link ((N−1)·P, N−1 rounds)."""
    sizes = [numels] if isinstance(numels, int) else list(numels)
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective '{op}'")
    if algorithm not in ("ring", "naive"):
        raise ValueError(f"unknown algorithm '{algorithm}'; choose ring or naive")
    steps = world - 1
    if algorithm == "naive" and op == "all_reduce":
        sent, rounds = steps * sum(sizes), steps * len(sizes)
    else:
        phases = 2 if op == "all_reduce" else 1
        sent = phases * steps * sum(shard_numel(p, world) for p in sizes)
        rounds = phases * steps * len(sizes)
    return CollectiveCost(op, what, sent, sent * elem_bytes, rounds)


@dataclass
class Traffic:
    """Bytes one rank sends per optimizer step, plus host↔device copies under offload."""

    collectives: list[CollectiveCost]
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0

    @property
    def sent_numel(self) -> int:
        return sum(c.sent_numel for c in self.collectives)

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    def time_s(self, bandwidth_gbps: float, latency_us: float) -> float:
        return sum(c.time_s(bandwidth_gbps, latency_us) for c in self.collectives)


def traffic_per_step(psi: int | Sequence[int], world_size: int, stage: int, *,
                     param_bytes: int, grad_bytes: int, offload: bool = False,
                     algorithm: str = "ring", muon_matrix_numel: int = 0,
                     update_bytes: int = 4) -> Traffic:
    """SPEC §6 traffic column: DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ (each ×(N−1)/N, in elements).

    ZeRO-1 does not all-reduce: reduce-scatter grads, then all-gather the updated params.
    Offload keeps the collectives of its stage and adds a grad shard down, param shard up.
    `muon_matrix_numel`: elements of the matrices distributed Muon owns whole (stages
    1–3 add its two all-to-alls, `muon_mean_traffic`; stage 0 replicates Muon: nothing).
    """
    if offload and stage < 2:
        raise ValueError("offload needs stage 2 or 3")
    n = world_size
    sizes = [psi] if isinstance(psi, int) else list(psi)
    if stage == 0:
        colls = [collective_cost("all_reduce", sizes, n, grad_bytes, algorithm=algorithm,
                                 what="grads")]
    else:
        gathers = ["params (fwd)", "params (bwd)"] if stage == 3 else ["params"]
        colls = [collective_cost("reduce_scatter", sizes, n, grad_bytes, what="grads")]
        colls += [collective_cost("all_gather", sizes, n, param_bytes, what=w) for w in gathers]
        if muon_matrix_numel:
            colls += muon_mean_traffic(muon_matrix_numel, n, grad_bytes=grad_bytes,
                                       update_bytes=update_bytes)
    t = Traffic(colls)
    if offload:
        shard = sum(shard_numel(p, n) for p in sizes)
        t.device_to_host_bytes = shard * grad_bytes
        t.host_to_device_bytes = shard * param_bytes
    return t


# ----------------------------------------------------------------------------- Muon
# Distributed Muon (zero/muon.py, stages 1–3): each matrix is owned whole by one rank.
# Its momentum (4 B) lives on the owner only; the AdamW fallback's m and v (8 B) stay on
# the elementwise shards. Per step, two all-to-alls: the reduced gradient pieces to the
# owners, the orthogonalised update O back to the ranks holding the master slices.

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


def muon_traffic(pieces: Sequence[tuple[int, Sequence[int]]], rank: int, *, grad_bytes: int,
                 update_bytes: int = 4) -> list[CollectiveCost]:
    """What `rank` sends in distributed Muon's two all-to-alls, exactly, from the ownership
    table: per matrix (owner, its elements on each rank's shard). Gradients: every piece
    this rank holds of a matrix another rank owns. Updates: every piece of this rank's
    own matrices that another rank holds."""
    grads = sum(sizes[rank] for owner, sizes in pieces if owner != rank)
    updates = sum(sum(sizes) - sizes[rank] for owner, sizes in pieces if owner == rank)
    rounds = len(pieces[0][1]) - 1 if pieces else 0
    return [CollectiveCost("all_to_all", "muon grads", grads, grads * grad_bytes, rounds),
            CollectiveCost("all_to_all", "muon updates", updates, updates * update_bytes,
                           rounds)]


def muon_mean_traffic(matrix_numel: int, world_size: int, *, grad_bytes: int,
                      update_bytes: int = 4) -> list[CollectiveCost]:
    """`muon_traffic` averaged over ranks: a matrix's owner holds 1/N of it on average,
    so (N−1)/N of it travels each way, spread over N senders: (N−1)/N²·Ψ_mat per rank."""
    n = world_size
    each = matrix_numel * (n - 1) // (n * n)
    return [CollectiveCost("all_to_all", "muon grads", each, each * grad_bytes, n - 1),
            CollectiveCost("all_to_all", "muon updates", each, each * update_bytes, n - 1)]


# ----------------------------------------------------------------------------- activations


def block_activation_bytes(b: int, s: int, h: int, a: int, *, mlp_ratio: int = 4,
                           act_bytes: int = 2, stat_bytes: int = 4) -> int:
    """Bytes autograd saves in one reference GPT block (dropout 0), from its ops:

    ln1 input x, ln1 out (for qkv), qkv out (q, k, v are views of it, saved by SDPA),
    SDPA out (also proj's input: a view), x + attn (ln2 input), ln2 out (for fc),
    fc out (for GELU), GELU out (for proj): (8 + 2·mlp_ratio)·b·s·h elements; plus
    mean and rstd of both LayerNorms (4·b·s) and SDPA's logsumexp (a·b·s), both fp32.
    Assumes a memory-efficient SDPA kernel (flash on CPU/CUDA): no s×s matrix is stored.
    """
    bsh = b * s * h
    return (8 + 2 * mlp_ratio) * bsh * act_bytes + (4 * b * s + a * b * s) * stat_bytes


def head_activation_bytes(b: int, s: int, h: int, vocab: int, *, act_bytes: int = 2,
                          stat_bytes: int = 4) -> int:
    """Outside the blocks: ln_f input and output, fp32 log-probs (the loss is fp32 whatever
    the dtype), int64 token ids (embedding, targets) and positions, the loss's weight scalar."""
    return 2 * b * s * h * act_bytes + 2 * b * s * stat_bytes + b * s * vocab * 4 \
        + 8 * (2 * b * s + s) + 4


def activation_bytes(model_cfg: ModelConfig, micro_batch: int, seq: int, *,
                     act_bytes: int = 2, checkpointing: bool | None = None) -> int:
    """Saved activations of a GPT forward at their peak (before backward frees them).

    Checkpointing keeps only each block's input, and recomputes one block at a time in
    backward, which briefly holds that block's full activations again. Dropout > 0 adds
    one 1-byte mask per dropout (CUDA's fused kernel; CPU keeps a full-dtype noise tensor).
    """
    c = model_cfg
    ckpt = c.activation_checkpointing if checkpointing is None else checkpointing
    b, s, h = micro_batch, seq, c.n_embd
    block = block_activation_bytes(b, s, h, c.n_head, mlp_ratio=c.mlp_ratio,
                                   act_bytes=act_bytes)
    if c.dropout > 0:
        block += 2 * b * s * h
    head = head_activation_bytes(b, s, h, c.vocab_size, act_bytes=act_bytes) \
        + (b * s * h if c.dropout > 0 else 0)
    if ckpt:
        inp = b * s * h * act_bytes
        return c.n_layer * inp + (block - inp) + head
    return c.n_layer * block + head


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


# ----------------------------------------------------------------------------- measured


def measured_process_memory(device: torch.device | None = None) -> dict[str, int]:
    """What the operating system / allocator says this process holds right now.

    CPU: resident set size (current and peak, from /proc). CUDA: allocator peak. These
    include activations, buffers, the framework itself — the model-state audit
    (`Strategy.memory_breakdown`) is the part the formulas predict.
    """
    out: dict[str, int] = {}
    status = proc_status()
    if status:
        out["rss_bytes"], out["peak_rss_bytes"] = status["VmRSS"], status["VmHWM"]
    else:
        import resource

        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device is not None and device.type == "cuda":
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The byte-valued fields of /proc/<pid>/status (VmRSS, VmHWM, ...); {} off Linux."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        return {}
    return out


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux ≥ 4.0: write 5 to clear_refs), so the next
    reading is the peak of a phase; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
