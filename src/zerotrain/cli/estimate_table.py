"""How `zerotrain estimate` shows a report: the table, and the stacked-bar plot.

Both pick one unit for all their numbers from the numbers themselves (`table_unit`): MB
for a small model, GB for a 7B one, in the family of --gpu-mem (GB = 10^9, GiB = 2^30).
"""

from __future__ import annotations

from pathlib import Path

from zerotrain.cli.estimate_compact import compact_lines
from zerotrain.cli.units import pick_unit, table_unit, unit_words
from zerotrain.memory import FIELDS
from zerotrain.memory.experts import expert_lines

_W = 9  # column width
_COLS = ["params", "grads", "master", "optim", "gathered", "activ", "TOTAL"]
_HCOLS = ["grads", "master", "optim", "TOTAL"]
# with ZeRO-Infinity rows: host params and the tiers' buffers, and a disk group
_HCOLS_TIERS = ["params", "grads", "master", "optim", "buffers", "TOTAL"]
_DCOLS = ["params", "master", "optim", "TOTAL"]


def tiered(rep: dict) -> bool:
    """Whether a row keeps parameters off the device or anything on disk."""
    return any(r.get("offload_param", "none") != "none" or r.get("offload_optimizer") == "nvme"
               for r in rep["rows"])


def _label_width(rep: dict) -> int:
    return max([15, *(len(r["label"]) + 1 for r in rep["rows"])])


def display_unit(rep: dict) -> tuple[str, int]:
    """One unit for every number of the report."""
    values = [v for r in rep["rows"]
              for v in (r["device_total"], r["host_total"], r["traffic"]["sent_bytes"])]
    return table_unit(values, binary=rep["unit"] == "GiB")


def _limit(nbytes: int, binary: bool) -> str:
    """A limit in its own best unit: '80 GB', '1 GiB'."""
    name, factor = pick_unit(nbytes, binary)
    return f"{nbytes / factor:g} {name}"


def _fmt(x: float, u: int) -> str:
    return f"{x / u:{_W}.2f}" if x else f"{'-':>{_W}}"


def _fits_text(r: dict) -> str:
    if r["fits"] is False:
        return "  DOES NOT FIT"
    if r.get("host_fits") is False:
        return "  DOES NOT FIT (host)"
    if r.get("disk_fits") is False:
        return "  DOES NOT FIT (disk)"
    return "  FITS"


def _head(rep: dict, unit: tuple[str, int]) -> list[str]:
    bpp, lim, binary = rep["bytes_per_param"], rep["gpu_mem"], rep["unit"] == "GiB"
    limits = [f"device limit {_limit(lim, binary)}"] if lim is not None else []
    if rep.get("host_mem") is not None:
        limits.append(f"host limit {_limit(rep['host_mem'], binary)}")
    if rep.get("disk") is not None:
        limits.append(f"disk limit {_limit(rep['disk'], binary)}")
    # a MoE: memory holds every expert (Ψ), a token's compute uses the active ones
    active = (f" ({rep['active_params']:,} active per token: a mixture of experts)"
              if rep.get("active_params", rep["psi"]) != rep["psi"] else "")
    lines = [
        f"zerotrain estimate: Ψ = {rep['psi']:,} params{active} on N = {rep['world_size']} "
        f"ranks, {rep['precision']} (grads {rep['grad_dtype']}), {rep['optimizer']}",
        "bytes/param: params {params}, grads {grads}, master {master}, optimizer {optimizer}"
        .format(**bpp) + (f" (+{bpp['comp']} Kahan)" if bpp.get("comp") else "")
        + f"  (K = {bpp['master'] + bpp.get('comp', 0) + bpp['optimizer']})",
        f"memory per rank in {unit_words(unit)}" + "".join(f"; {x}" for x in limits),
    ]
    if rep["activations"]:
        mode = rep["activation_checkpointing"]
        how = [" checkpointed, block inputs offloaded to host" if mode == "offload"
               else " checkpointed" if mode else "",
               f" tiles of {rep['tile_tokens']} tokens" if rep.get("tile_tokens") else ""]
        how = [x for x in how if x]
        lines.append(f"activations: micro-batch {rep['micro_batch']} × seq {rep['seq']}"
                     + (f" ({','.join(how)[1:]})" if how else "")
                     + f": peak {rep['activations'] / unit[1]:.2f} {unit[0]}, saved "
                     f"{rep['activations_saved'] / unit[1]:.2f}"
                     + (f", host {rep['activations_host'] / unit[1]:.2f}"
                        if rep.get("activations_host") else ""))
    return lines


def _row_line(r: dict, u: int, limits: bool, lw: int = 15, tiers: bool = False) -> str:
    d, h = r["device"], r["host"]
    vals = [d["params"], d["grads"], d["master"], d["optimizer"], r["gathered"],
            r["activations"], r["device_total"]]
    hv = [h["grads"], h["master"], h["optimizer"], r["host_total"]]
    if tiers:
        hv = [h["params"], *hv[:3], r["staging"]["host"], r["host_total"]]
        k = r["disk"]
        hv += [k["params"], k["master"], k["optimizer"], r["disk_total"]]
    line = (f"{r['label']:<{lw}}|" + "".join(_fmt(v, u) for v in vals) + " |"
            + "".join(_fmt(v, u) for v in hv[:len(hv) - 4 * tiers]) + " |"
            + ("".join(_fmt(v, u) for v in hv[-4:]) + " |" if tiers else "")
            + f"{_fmt(r['traffic']['sent_bytes'], u)}")
    if "time_s" in r["traffic"]:
        line += f" {r['traffic']['time_s'] * 1e3:{_W}.1f}"
    return line + (_fits_text(r) if limits else "")


def _notes(rep: dict, unit: tuple[str, int]) -> list[str]:
    (name, u), lines = unit, []
    off = next((r["traffic"] for r in rep["rows"] if r["offload"]), None)
    if off and not tiered(rep):
        d2h, h2d = off["device_to_host_bytes"] / u, off["host_to_device_bytes"] / u
        lines.append(f"offload rows also copy per step and rank: {d2h:.2f} {name} grad shard "
                     f"device→host, {h2d:.2f} {name} param shard host→device (not in 'sent')")
    if any("params" in r["shards"] for r in rep["rows"]) and not rep["largest_unit"]:
        lines.append("ZeRO-3 'gathered' (the largest unit's full params) not counted: "
                     "pass --model or --largest-unit"
                     + (" (nor the tiers' buffers, a few unit shards)" if tiered(rep) else ""))
    if rep.get("muon_matrix_fraction") is not None:
        frac = rep["muon_matrix_fraction"]
        lines.append(f"muon: {frac:.1%} of Ψ are matrices"
                     f"{'' if frac < 1 else ' (pass --model for the real split)'}: momentum "
                     "4 B on the owning rank (mean 1/N above stage 0), AdamW m+v 8 B on the "
                     "rest; stages 1-3 add two all-to-alls (grads to owners, updates back)")
    lines.append("sent = bytes each rank sends in collectives per step (ring);"
                 " transient gradient buckets are not counted in memory")
    if rep["rows"] and rep["rows"][0].get("peaks") and rep.get("gpu_mem") is not None:
        lines.append("fits = the predicted peak per rank (below: runtime, transients and "
                     "allocator included) within the device limit, not TOTAL alone")
    if rep.get("left_out"):
        why = next(iter(rep["left_out"].values()))
        lines.append(f"not shown: {', '.join(rep['left_out'])}, which zerotrain train refuses "
                     f"with {rep['optimizer']} ({why})")
    return lines


def _largest_lines(rep: dict, unit: tuple[str, int]) -> list[str]:
    binary = rep["unit"] == "GiB"
    fixed = " (activations and gathered unit held fixed)" if rep["activations"] else ""
    host = f" and {_limit(rep['host_mem'], binary)} of host" if rep.get("host_mem") else ""
    disk = f" and {_limit(rep['disk'], binary)} of disk" if rep.get("disk") else ""
    lines = ["", f"largest Ψ that fits in {_limit(rep['gpu_mem'], binary)} per device{host}"
                 f"{disk}{fixed}:"]
    lw = _label_width(rep)
    for r in rep["rows"]:
        mp = r["max_params"]
        text = ("nothing fits (fixed costs exceed the limit)" if mp is None
                else f"{mp:,} ({mp / 1e9:.2f}B)")
        if r.get("max_params_unbounded"):
            text = (f"no limit given bounds it (its states grow off the device): give "
                    f"{r['max_params_unbounded']}")
        if mp is not None and r["host_total"] and rep.get("host_mem") is None:
            need = r["max_params_host_bytes"] / unit[1]
            text += (f", needing {need:.2f} {unit[0]} of host memory per rank "
                     "(bound it with --host-mem)")
        if mp is not None and r["disk_total"] and rep.get("disk") is None:
            need = r["max_params_disk_bytes"] / unit[1]
            text += f", {need:.2f} {unit[0]} of disk per rank (bound it with --disk)"
        lines.append(f"  {r['label']:<{lw - 1}} {text}")
    return lines


def _tier_traffic_lines(rep: dict, unit: tuple[str, int], lw: int) -> list[str]:
    """Bytes moved per step and rank between the tiers (`memory.tier_traffic`)."""
    (name, u), rows = unit, rep["rows"]
    cols = ["read", "written", "read", "written", "to dev", "from dev"]
    a = rows[0]["tier_traffic"]["micro_steps"] if rows else 1
    head = (f"{'stage':<{lw}}|{'host':^{2 * _W}} |{'disk':^{2 * _W}} |"
            f"{'device (PCIe)':^{2 * _W}} |")
    sub = f"{'':{lw}}|" + "".join(f"{c:>{_W}}" + (" |" if i % 2 else "")
                                  for i, c in enumerate(cols))
    lines = ["", f"bytes moved per step and rank between the tiers, {name} ({a} micro-step"
                 f"{'s' if a != 1 else ''}; parameters off the device are fetched for each "
                 "forward and backward, written back once; an optimizer on disk reads and "
                 "writes its master and moments once):", head, sub, "-" * len(sub)]
    for r in rows:
        t = r["tier_traffic"]
        vals = [t["host"]["read"], t["host"]["written"], t["disk"]["read"],
                t["disk"]["written"], t["device"]["written"], t["device"]["read"]]
        lines.append(f"{r['label']:<{lw}}|" + "".join(
            _fmt(v, u) + (" |" if i % 2 else "") for i, v in enumerate(vals)))
    return lines


def _longest_lines(rep: dict) -> list[str]:
    binary = rep["unit"] == "GiB"
    lines = ["", f"longest sequence that fits in {_limit(rep['gpu_mem'], binary)} per device "
                 f"(micro-batch {rep['micro_batch']}; the predicted peak per rank below: "
                 "model states, activations, runtime and allocator):"]
    for r in rep["rows"]:
        n = r["max_seq"]
        lines.append(f"  {r['label']:<{_label_width(rep) - 1}} " + (f"{n:,} tokens" if n else
                     "nothing fits (the peak at the shortest length exceeds the limit)"))
    return lines


def _peak_lines(rep: dict, unit: tuple[str, int]) -> list[str]:
    """--model: each row's predicted init and steady peak per rank (`predict_peaks`)."""
    rows = [r for r in rep["rows"] if "peaks" in r]
    if not rows:
        return []
    p0 = rows[0]["peaks"]
    # its own unit: a CPU rank's peaks include the torch runtime (hundreds of MB), which
    # would overflow the columns in the KB of a tiny model's states
    peaks = [v for r in rows for v in (r["peaks"]["init"], r["peaks"]["steady"],
                                       *(x + r["peaks"]["baseline"]
                                         for x in r["peaks"]["phases"].values()))]
    unit = table_unit(peaks, binary="i" in unit[0])
    what = ("resident memory of a CPU rank: the torch runtime "
            f"{p0['baseline'] / unit[1]:.2f} {unit[0]} + model states + transients + "
            "allocator retention" if p0["device"] == "cpu" else
            "bytes the CUDA allocator holds (max_memory_allocated)")
    lw = _label_width(rep)
    head = f"{'stage':<{lw}}|{'init':>{_W}}{'steady':>{_W}} |" + "".join(
        f"{c:>{_W}}" for c in ("forward", "backward", "step"))
    lines = ["", f"predicted peak per rank ({what}), {unit[0]}:", head, "-" * len(head)]
    for r in rows:
        ph = r["peaks"]["phases"]
        lines.append(f"{r['label']:<{lw}}|{_fmt(r['peaks']['init'], unit[1])}"
                     f"{_fmt(r['peaks']['steady'], unit[1])} |"
                     + "".join(_fmt(ph[k] + r["peaks"]["baseline"], unit[1])
                               for k in ("forward", "backward", "step")))
    return lines


def format_table(rep: dict) -> str:
    """The human table: one row per stage, device and host parts, traffic, FITS."""
    unit, tiers, lw = display_unit(rep), tiered(rep), _label_width(rep)
    limits = any(rep.get(k) is not None for k in ("gpu_mem", "host_mem", "disk"))
    hcols = _HCOLS_TIERS if tiers else _HCOLS
    head = (f"{'stage':<{lw}}|" + "".join(f"{c:>{_W}}" for c in _COLS) + " |"
            + "".join(f"{c:>{_W}}" for c in hcols) + " |"
            + ("".join(f"{c:>{_W}}" for c in _DCOLS) + " |" if tiers else "")
            + f"{'sent':>{_W}}")
    if any("time_s" in r["traffic"] for r in rep["rows"]):
        head += f" {'comm ms':>{_W}}"
    if limits:
        head += "  fits"
    groups = (f"{'':{lw}}|{'device per rank':^{_W * len(_COLS)}} |"
              f"{'host per rank':^{_W * len(hcols)}} |"
              + (f"{'disk per rank':^{_W * len(_DCOLS)}} |" if tiers else "")
              + f"{'per step':>{_W}}")
    lines = [*_head(rep, unit), groups, head, "-" * len(head)]
    lines += [_row_line(r, unit[1], limits, lw, tiers) for r in rep["rows"]]
    lines += _notes(rep, unit)
    if "expert_parallel" in rep:
        lines += expert_lines(rep["expert_parallel"])
    if tiers:
        lines += _tier_traffic_lines(rep, unit, lw)
    lines += _peak_lines(rep, unit)
    if rep["rows"] and "max_params" in rep["rows"][0]:
        lines += _largest_lines(rep, unit)
    if rep["rows"] and "max_seq" in rep["rows"][0]:
        lines += _longest_lines(rep)
    lines += compact_lines(rep, unit)
    return "\n".join(lines)


def plot_memory(rep: dict, path: Path) -> None:
    """Stacked device-memory bars per stage with the limit as a line (Agg, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (name, u), rows = display_unit(rep), rep["rows"]
    parts = [(f, lambda r, f=f: r["device"][f]) for f in FIELDS]
    parts += [("gathered unit", lambda r: r["gathered"]),
              ("activations", lambda r: r["activations"])]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for label, get in parts:
        vals = [get(r) / u for r in rows]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if rep["gpu_mem"] is not None:
        ax.axhline(rep["gpu_mem"] / u, color="k", ls="--", label="device memory")
    ax.set_xticks(list(x), [r["label"] for r in rows])
    ax.set_ylabel(f"{name} per device")
    ax.set_title(f"Ψ = {rep['psi']:,}, N = {rep['world_size']}, {rep['precision']}, "
                 f"{rep['optimizer']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
