"""`zerotrain estimate`: the memory model of `memory.py` as a table, a plot, and the
inverse question (the largest model that fits)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from zerotrain.config import ConfigError
from zerotrain.memory import (
    FIELDS,
    PRECISIONS,
    MemoryEstimate,
    activation_bytes,
    activation_dtype_bytes,
    bytes_per_param,
    max_params,
    model_state_bytes,
    traffic_per_step,
)
from zerotrain.models import model_size
from zerotrain.optim import state_bytes_per_param

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
        k = state_bytes_per_param(s["optimizer"], s["momentum"])
        s["bytes_per_param"] = asdict(bytes_per_param(s["precision"], k,
                                                      grad_dtype=s["grad_dtype"]))
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
        psi, largest = model_size(mc)
        s.update(psi=psi, largest_unit=largest, micro_batch=b,
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
