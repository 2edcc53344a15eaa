"""The memory and traffic model of SPEC §4–6, as formulas, plus `zerotrain estimate`.

Everything here is arithmetic on element counts and bytes per element; nothing is
allocated (parameter counting builds the model on the `meta` device). The engine's
measured memory audit is held against these numbers, so padding is explicit: a flat
buffer of P elements that is partitioned over N ranks is padded to N·ceil(P/N), and each
rank owns `shard_numel(P, N) = ceil(P/N)` of it.

Conventions: "bytes" are per rank; GB = 10^9 bytes, GiB = 2^30 bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from zerotrain.config import ConfigError, ModelConfig

FIELDS = ("params", "grads", "master", "optimizer")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")

# ----------------------------------------------------------------------------- counting


def _as_module(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    with torch.device("meta"):  # shapes only: a 70B model costs no memory to count
        return model_or_factory()


def count_params(model_or_factory: nn.Module | Callable[[], nn.Module]) -> int:
    """Unique parameter elements; tied weights count once (parameters() de-duplicates)."""
    return sum(p.numel() for p in _as_module(model_or_factory).parameters())


def unit_param_counts(model_or_factory: nn.Module | Callable[[], nn.Module]) -> dict[str, int]:
    """Elements per ZeRO-3 gather unit: each child of the first ModuleList, plus "root".

    ZeRO-3 materialises one unit at a time, so the largest unit sets the transient
    gathered memory. A tied weight belongs to the unit that names it first.
    """
    model = _as_module(model_or_factory)
    prefix = next((n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)), None)
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = "root"
        if prefix is not None and name.startswith(prefix + "."):
            unit = ".".join(name.split(".")[: prefix.count(".") + 2])
        units[unit] = units.get(unit, 0) + p.numel()
    return units


def largest_unit_params(model_or_factory: nn.Module | Callable[[], nn.Module]) -> int:
    return max(unit_param_counts(model_or_factory).values(), default=0)


def _gpt_factory(model_cfg: ModelConfig) -> Callable[[], nn.Module]:
    from zerotrain.models.gpt import GPT

    return lambda: GPT(model_cfg)


def gpt_param_count(model_cfg: ModelConfig) -> int:
    return count_params(_gpt_factory(model_cfg))


def gpt_largest_unit(model_cfg: ModelConfig) -> int:
    return largest_unit_params(_gpt_factory(model_cfg))


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


def bytes_per_param(precision: str = "bf16", optimizer: str = "adamw", *,
                    grad_dtype: str = "compute", momentum: float = 0.0) -> BytesPerParam:
    from zerotrain.optim import state_bytes_per_param

    p, g, m = precision_bytes(precision, grad_dtype)
    return BytesPerParam(p, g, m, state_bytes_per_param(optimizer, momentum))


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
             optimizer: str = "adamw", grad_dtype: str = "compute", offload: bool = False,
             momentum: float = 0.0, largest_unit: int = 0,
             activations: int = 0) -> MemoryEstimate:
    """`model_state_bytes` with the bytes per parameter looked up from names."""
    bpp = bytes_per_param(precision, optimizer, grad_dtype=grad_dtype, momentum=momentum)
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
                     algorithm: str = "ring") -> Traffic:
    """SPEC §6 traffic column: DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ (each ×(N−1)/N, in elements).

    ZeRO-1 does not all-reduce: reduce-scatter grads, then all-gather the updated params.
    Offload keeps the collectives of its stage and adds a grad shard down, param shard up.
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
    t = Traffic(colls)
    if offload:
        shard = sum(shard_numel(p, n) for p in sizes)
        t.device_to_host_bytes = shard * grad_bytes
        t.host_to_device_bytes = shard * param_bytes
    return t


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


# ----------------------------------------------------------------------------- CLI

ROWS = [("DDP", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3", 3, False),
        ("ZeRO-2+offload", 2, True), ("ZeRO-3+offload", 3, True)]
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def parse_size(text: str) -> tuple[int, str]:
    """'80GB' -> (80·10^9, 'GB'), '80GiB' -> (80·2^30, 'GiB'); a bare number means GB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise _UsageError(f"--gpu-mem '{text}' is not a size; write e.g. 80GB or 80GiB")
    prefix = (m.group(2) or "g").lower()
    unit = "GiB" if prefix.endswith("i") else "GB"
    return int(float(m.group(1)) * _UNITS[prefix]), unit


def parse_count(text: str, flag: str = "--params") -> int:
    """'7.5e9', '7.5B', '125M' -> an element count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise _UsageError(f"{flag} '{text}' is not a count; write e.g. 7.5e9 or 7.5B")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    n = round(float(m.group(1)) * scale)
    if n < 1:
        raise _UsageError(f"{flag} must be at least 1, got '{text}'")
    return n


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerotrain estimate",
                description="Per-rank memory and traffic of DDP, ZeRO-1/2/3 and Offload "
                "(SPEC §6). Flags override --model's config file, which overrides defaults.")
    src = p.add_argument_group("model size (one of)")
    src.add_argument("--params", help="parameter count Ψ, e.g. 7.5e9 or 7.5B")
    src.add_argument("--model", metavar="CONFIG.yaml",
                     help="zerotrain config file: Ψ counted on the meta device, plus activations")
    p.add_argument("--gpus", type=int, required=True, help="data-parallel world size N")
    p.add_argument("--optimizer", help="optimizer name (default adamw)")
    p.add_argument("--momentum", type=float, help="SGD/RMSProp momentum (adds a state)")
    p.add_argument("--precision", choices=PRECISIONS, help="default bf16 (mixed)")
    p.add_argument("--grad-dtype", choices=("compute", "fp32"), help="default compute")
    p.add_argument("--gpu-mem", help="device memory, e.g. 80GB or 80GiB (table uses its unit)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="show only this stage")
    p.add_argument("--offload", action="store_true", help="show only the offload rows")
    p.add_argument("--largest-unit", help="ZeRO-3 gather unit in elements (--params mode)")
    p.add_argument("--micro-batch", type=int, help="sequences per rank (--model; default data)")
    p.add_argument("--seq", type=int, help="sequence length (--model; default block_size)")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="keep only block inputs (--model; default from the config)")
    p.add_argument("--max-params", action="store_true",
                   help="largest Ψ per stage that fits in --gpu-mem")
    p.add_argument("--bandwidth", type=float, help="link GB/s: adds α–β comm time per step")
    p.add_argument("--latency", type=float, default=5.0, help="link latency in µs (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="stacked bar chart of device memory per stage")
    return p


def _resolve(args: argparse.Namespace) -> dict:
    """Turn flags (and an optional config file) into one plain settings dict."""
    if (args.params is None) == (args.model is None):
        raise _UsageError("give exactly one of --params N or --model CONFIG.yaml")
    if args.gpus < 1:
        raise _UsageError(f"--gpus must be >= 1, got {args.gpus}")
    cfg = None
    if args.model:
        try:
            from zerotrain.config import load_config
            cfg = load_config(args.model)
        except ConfigError as e:
            raise _UsageError(str(e)) from None
    elif args.micro_batch or args.seq or args.activation_checkpointing:
        raise _UsageError("--micro-batch/--seq/--activation-checkpointing need --model "
                          "(activations depend on the model's shape)")

    def pick(flag, from_cfg, default):
        return flag if flag is not None else (from_cfg() if cfg is not None else default)

    s = {
        "world_size": args.gpus,
        "precision": pick(args.precision, lambda: cfg.precision.dtype, "bf16"),
        "grad_dtype": pick(args.grad_dtype, lambda: cfg.precision.grad_accum_dtype, "compute"),
        "optimizer": pick(args.optimizer, lambda: cfg.optimizer.name, "adamw"),
        "momentum": pick(args.momentum, lambda: cfg.optimizer.momentum, 0.0),
        "activations": 0, "largest_unit": 0,
    }
    try:
        s["bytes_per_param"] = asdict(bytes_per_param(
            s["precision"], s["optimizer"], grad_dtype=s["grad_dtype"], momentum=s["momentum"]
        ))
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if cfg is not None:
        mc = cfg.model
        b = pick(args.micro_batch, lambda: cfg.data.micro_batch_size, 1)
        seq = pick(args.seq, lambda: mc.block_size, 1)
        if b < 1 or not 1 <= seq <= mc.block_size:
            raise _UsageError(f"--micro-batch must be >= 1 and --seq in 1..{mc.block_size} "
                              f"(model.block_size); got {b} and {seq}")
        ckpt = pick(args.activation_checkpointing, lambda: mc.activation_checkpointing, False)
        s.update(psi=gpt_param_count(mc), largest_unit=gpt_largest_unit(mc), micro_batch=b,
                 seq=seq, activation_checkpointing=ckpt,
                 activations=activation_bytes(mc, b, seq, checkpointing=ckpt,
                                              act_bytes=activation_dtype_bytes(s["precision"])))
    else:
        s["psi"] = parse_count(args.params)
        if args.largest_unit is not None:
            s["largest_unit"] = parse_count(args.largest_unit, "--largest-unit")
    s["gpu_mem"], s["unit"] = parse_size(args.gpu_mem) if args.gpu_mem else (None, "GB")
    if args.max_params and s["gpu_mem"] is None:
        raise _UsageError("--max-params needs --gpu-mem (the limit to fit under)")
    if args.bandwidth is not None and (args.bandwidth <= 0 or args.latency < 0):
        raise _UsageError("--bandwidth must be > 0 GB/s and --latency >= 0 µs")
    return s


def _row(s: dict, stage: int, offload: bool, psi: int | None = None) -> MemoryEstimate:
    bpp = s["bytes_per_param"]
    est = model_state_bytes(
        s["psi"] if psi is None else psi, s["world_size"], stage, param_bytes=bpp["params"],
        grad_bytes=bpp["grads"], master_bytes=bpp["master"], optim_bytes=bpp["optimizer"],
        offload=offload, largest_unit=s["largest_unit"])
    est.activations = s["activations"]
    return est


def _report(s: dict, rows: list[tuple[str, int, bool]], args: argparse.Namespace) -> dict:
    bpp, lim = s["bytes_per_param"], s["gpu_mem"]
    out: dict = {k: v for k, v in s.items()}
    out["unit_bytes"] = 2**30 if s["unit"] == "GiB" else 10**9
    out["rows"] = []
    for label, stage, off in rows:
        est = _row(s, stage, off)
        tr = traffic_per_step(s["psi"], s["world_size"], stage, param_bytes=bpp["params"],
                              grad_bytes=bpp["grads"], offload=off)
        r = {"label": label, "stage": stage, "offload": off, "device": est.device,
             "host": est.host, "gathered": est.gathered, "activations": est.activations,
             "padding_elems": est.padding_elems, "device_total": est.device_total,
             "host_total": est.host_total,
             "fits": None if lim is None else est.device_total <= lim,
             "traffic": {"sent_numel": tr.sent_numel, "sent_bytes": tr.sent_bytes,
                         "device_to_host_bytes": tr.device_to_host_bytes,
                         "host_to_device_bytes": tr.host_to_device_bytes,
                         "collectives": [asdict(c) for c in tr.collectives]}}
        if args.bandwidth is not None:
            r["traffic"]["time_s"] = tr.time_s(args.bandwidth, args.latency)
        if args.max_params:
            r["max_params"] = max_params(lambda p, st=stage, o=off:
                                         _row(s, st, o, p).device_total <= lim)
        out["rows"].append(r)
    return out


_W = 9  # column width


def _fmt(x: float, u: float) -> str:
    return f"{x / u:{_W}.2f}" if x else f"{'-':>{_W}}"


def format_table(rep: dict) -> str:
    """The human table: one row per stage, device and host parts, traffic, FITS."""
    u, unit, bpp = rep["unit_bytes"], rep["unit"], rep["bytes_per_param"]
    lim = rep["gpu_mem"]
    lines = [
        f"zerotrain estimate: Ψ = {rep['psi']:,} params on N = {rep['world_size']} ranks, "
        f"{rep['precision']} (grads {rep['grad_dtype']}), {rep['optimizer']}",
        "bytes/param: params {params}, grads {grads}, master {master}, optimizer {optimizer}"
        .format(**bpp) + f"  (K = {bpp['master'] + bpp['optimizer']})",
        f"memory per rank in {unit} ({'2^30' if unit == 'GiB' else '10^9'} bytes)"
        + ("" if lim is None else f"; device limit {lim / u:g} {unit}"),
    ]
    if rep["activations"]:
        lines.append(f"activations: micro-batch {rep['micro_batch']} × seq {rep['seq']}"
                     f"{' (checkpointed)' if rep['activation_checkpointing'] else ''}")
    cols = ["params", "grads", "master", "optim", "gathered", "activ", "TOTAL"]
    hcols = ["grads", "master", "optim", "TOTAL"]
    head = (f"{'stage':<15}|" + "".join(f"{c:>{_W}}" for c in cols) + " |"
            + "".join(f"{c:>{_W}}" for c in hcols) + f" |{'sent':>{_W}}")
    if any("time_s" in r["traffic"] for r in rep["rows"]):
        head += f" {'comm ms':>{_W}}"
    if lim is not None:
        head += "  fits"
    lines += [f"{'':15}|{'device per rank':^{_W * len(cols)}} |"
              f"{'host per rank':^{_W * len(hcols)}} |{'per step':>{_W}}",
              head, "-" * len(head)]
    for r in rep["rows"]:
        d, h = r["device"], r["host"]
        vals = [d["params"], d["grads"], d["master"], d["optimizer"], r["gathered"],
                r["activations"], r["device_total"]]
        hv = [h["grads"], h["master"], h["optimizer"], r["host_total"]]
        line = (f"{r['label']:<15}|" + "".join(_fmt(v, u) for v in vals) + " |"
                + "".join(_fmt(v, u) for v in hv) + f" |{_fmt(r['traffic']['sent_bytes'], u)}")
        if "time_s" in r["traffic"]:
            line += f" {r['traffic']['time_s'] * 1e3:{_W}.1f}"
        if lim is not None:
            line += "  FITS" if r["fits"] else "  DOES NOT FIT"
        lines.append(line)
    off = next((r["traffic"] for r in rep["rows"] if r["offload"]), None)
    if off:
        d2h, h2d = off["device_to_host_bytes"] / u, off["host_to_device_bytes"] / u
        lines.append(f"offload rows also copy per step and rank: {d2h:.2f} {unit} grad shard "
                     f"device→host, {h2d:.2f} {unit} param shard host→device (not in 'sent')")
    if any(r["stage"] == 3 for r in rep["rows"]) and not rep["largest_unit"]:
        lines.append("ZeRO-3 'gathered' (the largest unit's full params) not counted: "
                     "pass --model or --largest-unit")
    lines.append("sent = bytes each rank sends in collectives per step (ring);"
                 " transient gradient buckets are not counted in memory")
    if rep["rows"] and "max_params" in rep["rows"][0]:
        fixed = " (activations and gathered unit held fixed)" if rep["activations"] else ""
        lines += ["", f"largest Ψ that fits in {lim / u:g} {unit} per device{fixed}:"]
        for r in rep["rows"]:
            mp = r["max_params"]
            lines.append(f"  {r['label']:<15} " + ("nothing fits (fixed costs exceed the limit)"
                         if mp is None else f"{mp:,} ({mp / 1e9:.2f}B)"))
    return "\n".join(lines)


def plot_memory(rep: dict, path: str) -> None:
    """Stacked device-memory bars per stage with the limit as a line (Agg, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    u, rows = rep["unit_bytes"], rep["rows"]
    parts = [(f, lambda r, f=f: r["device"][f]) for f in FIELDS]
    parts += [("gathered unit", lambda r: r["gathered"]),
              ("activations", lambda r: r["activations"])]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for name, get in parts:
        vals = [get(r) / u for r in rows]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if rep["gpu_mem"] is not None:
        ax.axhline(rep["gpu_mem"] / u, color="k", ls="--", label="device memory")
    ax.set_xticks(list(x), [r["label"] for r in rows])
    ax.set_ylabel(f"{rep['unit']} per device")
    ax.set_title(f"Ψ = {rep['psi']:,}, N = {rep['world_size']}, {rep['precision']}, "
                 f"{rep['optimizer']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main_estimate(argv: list[str]) -> int:
    """`zerotrain estimate`: prints the table (or JSON); 2 with one message on bad input."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        s = _resolve(args)
    except _UsageError as e:
        print(f"zerotrain estimate: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    rows = [r for r in ROWS if (args.stage is None or r[1] == args.stage)
            and (not args.offload or r[2])]
    if not rows:
        print(f"zerotrain estimate: error: stage {args.stage} has no offload variant "
              "(offload needs stage 2 or 3)", file=sys.stderr)
        return 2
    rep = _report(s, rows, args)
    if args.plot:
        try:
            plot_memory(rep, args.plot)
        except OSError as e:
            print(f"zerotrain estimate: error: cannot write --plot {args.plot}: {e}",
                  file=sys.stderr)
            return 2
    print(json.dumps(rep, indent=2) if args.json else format_table(rep))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_estimate(sys.argv[1:]))


# ----------------------------------------------------------------------------- measured


def measured_process_memory(device: torch.device | None = None) -> dict[str, int]:
    """What the operating system / allocator says this process holds right now.

    CPU: resident set size (current and peak, from /proc). CUDA: allocator peak. These
    include activations, buffers, the framework itself — the model-state audit
    (`Strategy.memory_breakdown`) is the part the formulas predict.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = (
                        int(rest.split()[0]) * 1024)
    except OSError:
        import resource

        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device is not None and device.type == "cuda":
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
