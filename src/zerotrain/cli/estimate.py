"""`zerotrain estimate`: the memory model of `memory.py` as a table, a plot, and the
inverse question (the largest model that fits a device, and the host beside it)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from zerotrain.cli.args import (
    Parser,
    UsageError,
    command,
    finite_float,
    parse_count,
    parse_size,
    plot_path,
    size_help,
)
from zerotrain.cli.estimate_compact import add_compact_flags, compact_rows, resolve_compact
from zerotrain.cli.estimate_ep import expert_shape, whole_model
from zerotrain.cli.estimate_peaks import peak_at, predict_peaks
from zerotrain.cli.estimate_rows import (
    ROWS,
    TIER_ROWS,
    Row,
    add_tier_flags,
    row_estimate,
    select_rows,
)
from zerotrain.memory import (
    FIELDS,
    PRECISIONS,
    MemoryEstimate,
    config_activations,
    max_params,
    max_seq,
    node_traffic,
    shape_traffic,
    tier_traffic,
)
from zerotrain.memory.experts import expert_rows
from zerotrain.zero.cut import model_size
from zerotrain.zero.experts import ep_problem

if TYPE_CHECKING:
    from zerotrain.config import Config

__all__ = ["ROWS", "TIER_ROWS", "main_estimate", "predict_peaks"]


def _build_parser() -> Parser:
    p = Parser("estimate", "Per-rank memory and traffic of DDP, ZeRO-1/2/3 and Offload "
               "(docs/design.md §zero, §offload). Flags override --model's config file, which "
               "overrides the defaults.")
    src = p.add_argument_group("model size (one of)")
    src.add_argument("--params", metavar="N", help="parameter count Ψ, e.g. 7.5e9 or 7.5B")
    src.add_argument("--model", metavar="CONFIG.yaml",
                     help="zerotrain config file: Ψ counted on the meta device, plus activations")
    p.add_argument("--gpus", metavar="N", type=int, required=True,
                   help="data-parallel world size")
    p.add_argument("--optimizer", metavar="NAME",
                   help="adamw, adam, sgd, adagrad, rmsprop, lion or muon (default: adamw)")
    p.add_argument("--momentum", metavar="M", type=finite_float,
                   help="SGD/RMSProp momentum (adds a state)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="compute precision (default: bf16 with fp32 master weights)")
    p.add_argument("--grad-dtype", choices=("compute", "fp32"),
                   help="gradient dtype (default: compute, the precision's own)")
    p.add_argument("--gpu-mem", metavar="SIZE",
                   help=f"device memory per GPU, e.g. 80GB or 80GiB ({size_help('GB')})")
    p.add_argument("--host-mem", "--host-memory", dest="host_mem", metavar="SIZE",
                   help="host memory per rank, for the offload rows, e.g. 512GB "
                   f"({size_help('GB')})")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="show only this stage")
    p.add_argument("--offload", action="store_true", help="show only the offload rows")
    add_tier_flags(p)
    add_compact_flags(p)
    p.add_argument("--largest-unit", metavar="N",
                   help="ZeRO-3 gather unit in elements (--params mode)")
    p.add_argument("--micro-batch", metavar="B", type=int,
                   help="sequences per rank (--model; default: data.micro_batch_size)")
    p.add_argument("--seq", metavar="S", type=int,
                   help="sequence length (--model; default: model.block_size)")
    p.add_argument("--activation-checkpointing", metavar="MODE", nargs="?", const=True,
                   type=_ckpt_mode, default=None,
                   help="true (alone: the flag), false or offload: keep only block inputs, "
                   "offload: in host memory (--model; default from the config)")
    p.add_argument("--tile-tokens", metavar="N", type=int, default=None,
                   help="sequence tiling of the loss and MLP, N tokens per tile (--model; "
                   "default: the config's sequence.tile_tokens)")
    p.add_argument("--max-seq", action="store_true",
                   help="longest sequence per stage that fits in --gpu-mem (--model; "
                   "activations at that length, model states as configured)")
    p.add_argument("--max-params", action="store_true",
                   help="largest Ψ per stage that fits in --gpu-mem (and --host-mem)")
    p.add_argument("--bandwidth", metavar="GB/S", type=finite_float,
                   help="link GB/s: adds α–β comm time per step")
    p.add_argument("--latency", metavar="US", type=finite_float, default=5.0,
                   help="link latency in µs")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="--model: what the init/steady peaks count — cpu: a rank's resident "
                   "memory (torch runtime, allocator retention); cuda: the allocator's bytes "
                   "(default: cuda when torch sees one, else cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE",
                   help="stacked bar chart of device memory per stage (.png, .pdf, .svg, ...)")
    return p


def _ckpt_mode(v: str) -> bool | str:
    modes: dict[str, bool | str] = {"true": True, "false": False, "offload": "offload"}
    if v.lower() not in modes:
        raise argparse.ArgumentTypeError(f"'{v}' is not true, false or offload")
    return modes[v.lower()]


def _load_model_config(args: argparse.Namespace) -> Config | None:
    if args.model:
        from zerotrain.config import load_config
        from zerotrain.models.presets import planned_model_config

        cfg = load_config(args.model)  # sizes of a preset / model.hf / the tokenizer's vocab
        return cfg.model_copy(update={"model": planned_model_config(cfg.model,
                                                                    cfg.data.tokenizer)})
    if (args.micro_batch or args.seq or args.activation_checkpointing is not None
            or args.tile_tokens is not None or args.max_seq):
        raise UsageError("--micro-batch/--seq/--activation-checkpointing/--tile-tokens/"
                         "--max-seq need --model (activations depend on the model's shape)")
    return None


def _resolve(args: argparse.Namespace) -> dict:
    """Turn flags (and an optional config file) into one plain settings dict."""
    if (args.params is None) == (args.model is None):
        raise UsageError("give exactly one of --params N or --model CONFIG.yaml")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")
    cfg = _load_model_config(args)
    if cfg is not None:
        _check_layout(cfg, args.gpus)

    def pick(flag, from_cfg, default):
        return flag if flag is not None else (from_cfg() if cfg is not None else default)

    s = {
        "world_size": args.gpus,
        "precision": pick(args.precision, lambda: cfg.precision.dtype, "bf16"),
        "grad_dtype": pick(args.grad_dtype, lambda: cfg.precision.grad_accum_dtype, "compute"),
        "optimizer": pick(args.optimizer, lambda: cfg.optimizer.name, "adamw"),
        "momentum": pick(args.momentum, lambda: cfg.optimizer.momentum, 0.0),
        "activations": 0, "largest_unit": 0,
        "offload_prefetch": pick(args.offload_prefetch, lambda: cfg.zero.offload_prefetch, 1),
        "micro_steps": pick(args.grad_accum, lambda: cfg.data.grad_accum_steps, 1),
        "device": args.device,  # --model resolves it below when not given
    }
    if not 0 <= s["offload_prefetch"] <= 8 or s["micro_steps"] < 1:
        raise UsageError(f"--offload-prefetch must be 0-8 and --grad-accum >= 1; got "
                         f"{s['offload_prefetch']} and {s['micro_steps']}")
    resolve_compact(args, s, cfg)
    if cfg is not None:
        s.update(_model_settings(args, cfg, pick, s["precision"]))
    else:
        s["psi"] = parse_count(args.params, "--params")
        if args.largest_unit is not None:
            s["largest_unit"] = parse_count(args.largest_unit, "--largest-unit")
    if s["optimizer"] == "muon":  # without --model every parameter counts as a matrix
        s["muon_matrix_fraction"] = _matrix_fraction(cfg) if cfg is not None else 1.0
    s.update(_limits(args))
    return s


def _check_layout(cfg: Config, gpus: int) -> None:
    """The layouts `zerotrain train` refuses are refused here too, in its words (not
    estimated as if they ran)."""
    from zerotrain.config import ConfigError, check_sequence_parallel

    try:
        check_sequence_parallel(cfg.sequence.parallel, gpus)
    except ConfigError as e:
        raise UsageError(f"{e} (--gpus is the world size)") from None
    ep = cfg.model.moe.expert_parallel if cfg.model.moe is not None else 1
    if ep_problem(ep, gpus):
        raise UsageError(f"{ep_problem(ep, gpus)} (--gpus is the world size)")
    d = cfg.data
    if d.document_mask and d.eos_token_id is None and d.tokenizer == "bytes" \
            and cfg.model.hf is None:
        raise UsageError("data.document_mask needs the token that ends a document, and the "
                         "byte tokenizer has none: use data.tokenizer bpe:N or a Hugging "
                         "Face tokenizer, set data.eos_token_id, or set data.document_mask "
                         "false")


def _matrix_fraction(cfg: Config) -> float:
    """The share of the parameters Muon orthogonalises (the plan's MATRIX group, 2-D+);
    the rest (embeddings, head, vectors) takes its AdamW fallback."""
    from zerotrain.models import Group, build_model, plan_for

    model = build_model(cfg.model, device="meta")
    plan = plan_for(model)
    sizes = [(p.numel(), plan.group_of(n) == Group.MATRIX and p.ndim >= 2)
             for n, p in model.named_parameters()]
    return sum(k for k, mat in sizes if mat) / max(1, sum(k for k, _ in sizes))


def _model_settings(args: argparse.Namespace, cfg: Config, pick: Callable[..., Any],
                    precision: str) -> dict:
    """Ψ, the ZeRO-3 unit and the activations of the config's reference GPT."""
    mc = cfg.model
    b = pick(args.micro_batch, lambda: cfg.data.micro_batch_size, 1)
    seq = pick(args.seq, lambda: mc.block_size, 1)
    if b < 1 or not 1 <= seq <= mc.block_size:
        raise UsageError(f"--micro-batch must be >= 1 and --seq in 1..{mc.block_size} "
                         f"(model.block_size); got {b} and {seq}")
    ckpt = pick(args.activation_checkpointing, lambda: mc.activation_checkpointing, False)
    tile = pick(args.tile_tokens, lambda: cfg.sequence.tile_tokens, None)
    if tile is not None and tile < 1:
        raise UsageError(f"--tile-tokens must be >= 1, got {tile}")
    psi, largest = model_size(whole_model(mc))  # every expert, whatever the EP degree
    from zerotrain.models import active_param_count

    active = active_param_count(mc)  # a MoE's top_k experts; = psi for a dense model
    # the config as the flags change it, for the per-phase peaks (`predict_peaks`)
    run_cfg = cfg.model_copy(update={
        "model": mc.model_copy(update={"activation_checkpointing": ckpt}),
        "sequence": cfg.sequence.model_copy(update={"tile_tokens": tile}),
        "precision": cfg.precision.model_copy(update={
            "dtype": precision, "grad_accum_dtype": pick(
                args.grad_dtype, lambda: cfg.precision.grad_accum_dtype, "fp32")}),
        "zero": cfg.zero.model_copy(update={"offload_prefetch": pick(
            args.offload_prefetch, lambda: cfg.zero.offload_prefetch, 1)}),
        "data": cfg.data.model_copy(update={"grad_accum_steps": pick(
            args.grad_accum, lambda: cfg.data.grad_accum_steps, 1)}),
        "optimizer": cfg.optimizer.model_copy(update={
            "name": pick(args.optimizer, lambda: cfg.optimizer.name, "adamw"),
            "momentum": pick(args.momentum, lambda: cfg.optimizer.momentum, 0.0)})})
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    acts = config_activations(run_cfg, b, seq, device=args.device)
    return dict(psi=psi, active_params=active, largest_unit=largest, micro_batch=b,
                config=run_cfg, experts=expert_shape(mc, psi),
                device=args.device, seq=seq, activation_checkpointing=ckpt, tile_tokens=tile,
                activations=acts.peak, activations_saved=acts.saved,
                activations_host=acts.host)


def _limits(args: argparse.Namespace) -> dict:
    gpu = parse_size(args.gpu_mem, "--gpu-mem", bare_unit="GB") if args.gpu_mem else None
    host = parse_size(args.host_mem, "--host-mem", bare_unit="GB") if args.host_mem else None
    disk = parse_size(args.disk, "--disk", bare_unit="GB") if args.disk else None
    if (args.max_params or args.max_seq) and gpu is None:
        raise UsageError("--max-params/--max-seq need --gpu-mem (the limit to fit under)")
    if args.bandwidth is not None and (args.bandwidth <= 0 or args.latency < 0):
        raise UsageError("--bandwidth must be > 0 GB/s and --latency >= 0 µs")
    binary = (gpu or host).binary if (gpu or host) else False
    return {"gpu_mem": gpu.nbytes if gpu else None, "host_mem": host.nbytes if host else None,
            "disk": disk.nbytes if disk else None, "unit": "GiB" if binary else "GB"}


def _fits(s: dict, est: MemoryEstimate) -> tuple[bool | None, bool | None, bool | None]:
    """(fits the device, the host, the disk); None where no limit was given."""
    dev = None if s["gpu_mem"] is None else est.device_total <= s["gpu_mem"]
    host = None if s["host_mem"] is None else est.host_total <= s["host_mem"]
    disk = None if s["disk"] is None else est.disk_total <= s["disk"]
    return dev, host, disk


def _largest(s: dict, row: Row) -> dict:
    """The largest Ψ within the limits, and the host memory and disk a row needs there.
    A row that no limit given bounds (its growing states all in unlimited tiers) says
    which limit to give, instead of an answer."""
    def fits(p: int) -> bool:
        return all(x is not False for x in _fits(s, row_estimate(s, row, p)[0]))

    try:
        mp = max_params(fits)
    except ValueError as e:  # the bisection found no upper bound
        if not row.tiered:
            raise UsageError(f"--max-params: {e}; give a smaller --gpu-mem or --host-mem"
                             ) from None
        need = [f for f, lim, on in (("--host-mem", s["host_mem"], True), ("--disk", s["disk"],
                                     "nvme" in row)) if on and lim is None]
        return {"max_params": None, "max_params_host_bytes": 0, "max_params_disk_bytes": 0,
                "max_params_unbounded": " or ".join(need) or "smaller limits"}
    est = row_estimate(s, row, mp)[0] if mp is not None else None
    return {"max_params": mp, "max_params_host_bytes": est.host_total if est else 0,
            "max_params_disk_bytes": est.disk_total if est else 0}


def _longest(s: dict, row: Row) -> dict:
    """The longest sequence whose predicted peak per rank (`predict_peaks`: model states,
    activations, the runtime and the allocator's terms, as the table below shows it) fits
    in --gpu-mem (the inverse of the activation model, like --max-params for Ψ)."""
    peak = peak_at(s["config"], s["world_size"], row.stage, row.offload_optimizer,
                   device=s["device"], micro_batch=s["micro_batch"],
                   offload_param=row.offload_param)
    longest = max_seq(lambda seq: peak(seq) <= s["gpu_mem"],
                      multiple=s["config"].sequence.parallel)
    acts = config_activations(s["config"], s["micro_batch"], longest, device=s["device"]) \
        if longest else None
    host = row_estimate({**s, "activations": acts.peak}, row)[0].host_total if acts else 0
    return {"max_seq": longest, "max_seq_tokens": longest * s["micro_batch"],
            "max_seq_peak_bytes": peak(longest) if longest else 0,
            "max_seq_activation_host_bytes": acts.host if acts else 0,
            "max_seq_host_bytes": host}


def _tiers_of(est: MemoryEstimate, shape) -> dict:
    """The JSON of a row's tiers: where each state lives, the buffers, bytes moved."""
    moves = tier_traffic(shape)
    return {"shards": sorted(shape.shards), "tiers": {f: shape.tier(f) for f in FIELDS},
            "disk": est.disk,
            "disk_total": est.disk_total, "staging": est.staging,
            "tier_traffic": {"micro_steps": shape.micro_steps, **moves.per_tier(),
                             "moves": [asdict(m) for m in moves.moves]}}


def _report(s: dict, rows: list[Row], args: argparse.Namespace) -> dict:
    out: dict = dict(s)
    out["unit_bytes"] = 2**30 if s["unit"] == "GiB" else 10**9
    out["rows"] = []
    for row in rows:
        est, shape = row_estimate(s, row)
        mats = round(s["psi"] * s.get("muon_matrix_fraction", 0.0))
        bpp = shape.bpp
        tr = shape_traffic(shape, muon_matrix_numel=mats,
                           update_bytes=bpp.master or bpp.params)
        dev_fits, host_fits, disk_fits = _fits(s, est)
        r = {"label": row.label, "stage": row.stage, "offload": row.offload,
             "offload_optimizer": row.offload_optimizer, "offload_param": row.offload_param,
             "device": est.device, "host": est.host, "gathered": est.gathered,
             "activations": est.activations, "padding_elems": est.padding_elems,
             "device_total": est.device_total, "host_total": est.host_total,
             "fits": dev_fits, "host_fits": host_fits, "disk_fits": disk_fits,
             "traffic": {"sent_numel": tr.sent_numel, "sent_bytes": tr.sent_bytes,
                         "device_to_host_bytes": tr.device_to_host_bytes,
                         "host_to_device_bytes": tr.host_to_device_bytes,
                         "collectives": [asdict(c) for c in tr.collectives]},
             **_tiers_of(est, shape)}
        node = s["config"].comm.node_size if "config" in s else None
        if node and node < s["world_size"]:  # bytes to other nodes (comm.node_size)
            r["traffic"]["inter_node_bytes"] = node_traffic(shape, node)[1]
        if args.bandwidth is not None:
            r["traffic"]["time_s"] = tr.time_s(args.bandwidth, args.latency)
        if args.max_params:
            r.update(_largest(s, row))
        if args.max_seq:
            r.update(_longest(s, row))
        if "config" in s:
            r["peaks"] = predict_peaks(s["config"], s["world_size"], row.stage,
                                       row.offload_optimizer, device=s["device"],
                                       micro_batch=s["micro_batch"], seq=s["seq"],
                                       offload_param=row.offload_param)
            if s["gpu_mem"] is not None:  # the peak the run reaches, not the states alone
                r["fits"] = max(r["peaks"]["init"], r["peaks"]["steady"]) <= s["gpu_mem"]
        out["rows"].append(r)
    out.pop("config", None)
    ex = out.pop("experts", None)
    if ex is not None:
        act = 2 if s["precision"] in ("bf16", "fp16") else 4
        out["expert_parallel"] = expert_rows(
            replace(ex, world=s["world_size"]), s["micro_batch"] * s["seq"], act,
            s["bytes_per_param"]["params"], s["micro_steps"])
    return out


@command("estimate")
def main_estimate(argv: list[str]) -> int:
    """`zerotrain estimate`: prints the table (or JSON); 2 with one message on bad input."""
    from zerotrain.cli.estimate_table import format_table, plot_memory

    args = _build_parser().parse_args(argv)
    plot = plot_path(args.plot) if args.plot else None
    s = _resolve(args)
    rows, refused = select_rows(args, s["optimizer"])
    if s["disk"] is not None and not any("nvme" in r for r in rows):
        raise UsageError("--disk bounds the nvme rows: add --offload-param nvme, "
                         "--offload-optimizer nvme or --tiers")
    rep = _report(s, rows, args)
    rep["left_out"] = refused
    rep["compact_rows"] = compact_rows(s, rows[-1].stage if args.stage is None else args.stage)
    if plot is not None:
        try:
            plot_memory(rep, plot)
        except OSError as e:
            raise UsageError(f"cannot write --plot '{plot}': {e.strerror or e}") from None
    print(json.dumps(rep, indent=2) if args.json else format_table(rep))
    if plot is not None:  # after the table; beside JSON it goes to stderr, to keep JSON clean
        print(f"plot written to {plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
