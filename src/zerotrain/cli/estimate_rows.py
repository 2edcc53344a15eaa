"""The rows of `zerotrain estimate`: each one a ZeRO configuration, stated as the config
states it (stage, offload_optimizer, offload_param), turned into a `memory.RunShape` by
its declarations (what the stage shards: `memory.STAGE_SHARDS`, the strategies' own
table; what is offloaded and where: `memory.declared_offloads`). Every number of a row
comes from the formulas reading that shape — none branches on a stage number.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from zerotrain.cli.args import UsageError, size_help
from zerotrain.memory import (
    STAGE_SHARDS,
    BytesPerParam,
    MemoryEstimate,
    RunShape,
    declared_offloads,
    muon_state_bytes,
    shape_state_bytes,
)


class Row(NamedTuple):
    label: str
    stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme (zero.offload_optimizer)
    offload_param: str = "none"      # none | cpu | nvme (zero.offload_param, stage 3)

    @property
    def offload(self) -> bool:
        """The optimizer's states are off the device (the historic `offload` column)."""
        return self.offload_optimizer != "none"

    @property
    def tiered(self) -> bool:
        """A ZeRO-Infinity row: parameters off the device, or anything on disk."""
        return self.offload_param != "none" or self.offload_optimizer == "nvme"

    def zero(self) -> dict:
        """The row as a zerotrain `zero:` section."""
        z = {"stage": self.stage, "offload_optimizer": self.offload_optimizer,
             "offload_param": self.offload_param}
        return z | ({"nvme_path": "/nvme"} if self.tiered else {})


_TIER_CHOICES = ("none", "cpu", "nvme")


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the offload tiers (mirroring zero.offload_* and the limits)."""
    p.add_argument("--disk", metavar="SIZE", help="disk space per rank for the nvme tiers "
                   f"(a node's free NVMe / its ranks), e.g. 2TB ({size_help('GB')})")
    p.add_argument("--offload-param", choices=_TIER_CHOICES,
                   help="ZeRO-Infinity: show only rows whose parameter shard lives here "
                   "between uses (zero.offload_param; stage 3)")
    p.add_argument("--offload-optimizer", choices=_TIER_CHOICES,
                   help="show only rows whose gradient shard, masters and moments live here "
                   "(zero.offload_optimizer; nvme: stage 3)")
    p.add_argument("--tiers", action="store_true",
                   help="also show every ZeRO-Infinity row (parameters and optimizer on "
                   "cpu or nvme), with disk columns and the bytes moved per tier")
    p.add_argument("--offload-prefetch", metavar="N", type=int,
                   help="offload tiers: units read ahead (zero.offload_prefetch; default 1, "
                   "or --model's)")
    p.add_argument("--grad-accum", metavar="A", type=int,
                   help="micro-batches per step: parameters off the device are fetched "
                   "for each (default 1, or --model's data.grad_accum_steps)")


def _label(opt: str, par: str) -> str:
    return "ZeRO-3" + (f" param:{par}" if par != "none" else "") + (
        f" opt:{opt}" if opt != "none" else "")


#: shown by default (SPEC §6's table and Offload)
ROWS = [Row("DDP", 0), Row("ZeRO-1", 1), Row("ZeRO-2", 2), Row("ZeRO-3", 3),
        Row("ZeRO-2+offload", 2, "cpu"), Row("ZeRO-3+offload", 3, "cpu")]
#: ZeRO-Infinity's tiers (stage 3): shown with --tiers, --offload-param, --offload-optimizer
TIER_ROWS = [Row(_label(opt, par), 3, opt, par) for par in ("none", "cpu", "nvme")
             for opt in ("none", "cpu", "nvme") if (opt, par) not in
             (("none", "none"), ("cpu", "none"))]


def training_refuses(optimizer: str, row: Row) -> str | None:
    """Why `zerotrain train` would refuse `optimizer` in this row, or None.

    The config validator answers, so the estimator offers exactly what training accepts
    and follows by itself when a rule changes.
    """
    from zerotrain.config import ConfigError, build_config

    try:
        build_config({"optimizer": {"name": optimizer}, "zero": row.zero()})
    except ConfigError as e:
        return str(e)
    return None


def _no_row(args: argparse.Namespace) -> UsageError:
    """Why the flags select no row: the config's own rule when there is one."""
    from zerotrain.config import ConfigError, build_config

    zero = {"stage": 3 if args.stage is None else args.stage,
            "offload_optimizer": args.offload_optimizer or ("cpu" if args.offload else "none"),
            "offload_param": args.offload_param or "none", "nvme_path": "/nvme"}
    try:
        build_config({"zero": zero})
    except ConfigError as e:
        return UsageError(f"no row for these flags: {e}")
    return UsageError("no row for these flags: --offload shows the rows whose optimizer is "
                      "offloaded; --offload-optimizer none shows none of them")


def select_rows(args: argparse.Namespace, optimizer: str) -> tuple[list[Row], dict[str, str]]:
    """The rows to show, and those left out because training refuses them (with why)."""
    tiers = args.tiers or args.offload_param is not None or args.offload_optimizer is not None
    rows = [r for r in ROWS + TIER_ROWS if (tiers or not r.tiered)
            and (args.stage is None or r.stage == args.stage)
            and (not args.offload or r.offload)
            and args.offload_param in (None, r.offload_param)
            and args.offload_optimizer in (None, r.offload_optimizer)]
    if not rows:
        raise _no_row(args)
    refused = {r.label: why for r in rows if (why := training_refuses(optimizer, r)) is not None}
    if refused and (args.stage is not None or len(refused) == len(rows)):
        label, why = next(iter(refused.items()))
        raise UsageError(f"{label} with --optimizer {optimizer}: zerotrain train refuses it "
                         f"({why})")
    return [r for r in rows if r.label not in refused], refused


def row_shape(s: dict, row: Row, psi: int | None = None) -> RunShape:
    """The row's shape: Ψ in one flat buffer, the row's declarations, the run's sizes.
    On a CPU device (--device cpu, or --model resolved to it) host memory is the
    device: the tiers are laid out as a CPU-only run lays them out (the gradient shard
    of an optimizer on disk goes to the disk too, as the engine's tier_bytes count)."""
    offloads, disk = declared_offloads(row.offload_optimizer, row.offload_param,
                                       host_is_device=s.get("device") == "cpu")
    z = s["config"].zero if "config" in s and row.stage == 3 else None  # ZeRO++ at stage 3
    return RunShape((s["psi"] if psi is None else psi,), s["world_size"],
                    BytesPerParam(**s["bytes_per_param"]), STAGE_SHARDS[row.stage],
                    offloads, disk, largest_unit=s["largest_unit"],
                    offload_prefetch=s["offload_prefetch"], micro_steps=s["micro_steps"],
                    secondary_partition=(z.secondary_partition or 0) if z else 0,
                    grad_wire_bits={"int8": 8, "int4": 4}.get(z.grad_wire, 0) if z else 0,
                    stage=row.stage)


def row_estimate(s: dict, row: Row, psi: int | None = None) -> tuple[MemoryEstimate, RunShape]:
    """Bytes per rank in each tier for this row (Muon's states placed by ownership)."""
    shape = row_shape(s, row, psi)
    est = shape_state_bytes(shape)
    est.activations = s["activations"]
    if "muon_matrix_fraction" in s:  # momentum on the owner only, m and v on the shards
        psi = shape.buffer_numels[0]
        mats = round(psi * s["muon_matrix_fraction"])
        place = {"device": est.device, "host": est.host, "disk": est.disk}
        place[shape.tier("optimizer")]["optimizer"] = muon_state_bytes(
            mats, psi - mats, s["world_size"], sharded="optimizer" in shape.shards)
    return est, shape
