"""Compact model states in `zerotrain estimate`: the flags (optimizer.state_dtype,
precision.master_dtype / master_update), the bytes per parameter they give, and the
table's extra rows — every combination side by side at this Ψ, N and stage
(docs/compact-states.md)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from zerotrain.cli.args import UsageError
from zerotrain.memory import STAGE_SHARDS, BytesPerParam, bytes_per_param, state_bytes

#: the rows the table gains: (label, state dtype, master dtype, master update)
COMBINATIONS = [
    ("fp32 states, fp32 master", "fp32", "fp32", None),
    ("bf16 states, fp32 master", "bf16", "fp32", None),
    ("int8 states, fp32 master", "int8", "fp32", None),
    ("int8 states, bf16 master + Kahan", "int8", "bf16", "kahan"),
    ("int8 states, bf16 master + stochastic", "int8", "bf16", "stochastic"),
    ("bf16-pure (bf16 states, plain)", "bf16", "bf16", "plain"),
]


def add_compact_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        help="optimizer.state_dtype (default fp32, or --model's)",
    )
    p.add_argument(
        "--master-dtype",
        choices=("fp32", "bf16"),
        help="precision.master_dtype (bf16 needs --precision bf16)",
    )
    p.add_argument(
        "--master-update",
        choices=("kahan", "stochastic", "plain"),
        help="precision.master_update of bf16 masters (default kahan)",
    )


def compact_bpp(
    precision: str,
    grad_dtype: str,
    optimizer: str,
    momentum: float,
    state_dtype: str,
    master_dtype: str | None,
    master_update: str | None,
) -> BytesPerParam:
    """Bytes per parameter of one combination; a UsageError for one training refuses."""
    from zerotrain.config import PrecisionConfig
    from zerotrain.optim import state_bytes_per_param

    try:
        prec = PrecisionConfig(
            dtype=precision, master_dtype=master_dtype, master_update=master_update
        )
        stored = (
            "bf16" if (state_dtype == "fp32" and prec.update_rule == "plain") else state_dtype
        )  # bf16-pure's states are made like its bf16 weights
        k = state_bytes_per_param(optimizer, momentum, stored)
        return bytes_per_param(
            precision,
            k,
            grad_dtype=grad_dtype,
            master_dtype=master_dtype,
            master_update=prec.update_rule,
        )
    except ValueError as e:  # pydantic's: its message alone
        errors = getattr(e, "errors", None)
        msg = errors()[0]["msg"].removeprefix("Value error, ") if errors else str(e)
        raise UsageError(msg) from None


def resolve_compact(args: argparse.Namespace, s: dict, cfg: Any) -> None:
    """Fill s["bytes_per_param"] (and the compact settings) from flags or --model."""

    def pick(flag: Any, section: str, key: str, default: Any) -> Any:
        if flag is not None:
            return flag
        return getattr(getattr(cfg, section), key) if cfg is not None else default

    s["state_dtype"] = pick(args.state_dtype, "optimizer", "state_dtype", "fp32")
    s["master_dtype"] = pick(args.master_dtype, "precision", "master_dtype", None)
    s["master_update"] = pick(args.master_update, "precision", "master_update", None)
    s["bytes_per_param"] = asdict(
        compact_bpp(
            s["precision"],
            s["grad_dtype"],
            s["optimizer"],
            s["momentum"],
            s["state_dtype"],
            s["master_dtype"],
            s["master_update"],
        )
    )


def compact_rows(s: dict, stage: int) -> list[dict]:
    """Every combination's bytes per parameter and model states per rank at `stage`."""
    out = []
    for label, sd, md, mu in COMBINATIONS:
        precision = "bf16" if md == "bf16" or s["precision"] == "bf16-pure" else s["precision"]
        if md == "bf16" and precision == "fp16":
            continue
        try:
            bpp = compact_bpp(precision, s["grad_dtype"], s["optimizer"], s["momentum"], sd, md, mu)
        except UsageError:
            continue
        est = state_bytes([s["psi"]], s["world_size"], STAGE_SHARDS[stage], frozenset(), bpp)
        per = bpp.params + bpp.grads + bpp.master + bpp.comp + bpp.optimizer
        out.append(
            {
                "label": label,
                "bytes_per_param": per,
                **asdict(bpp),
                "stage": stage,
                "model_states": sum(est.device.values()),
            }
        )
    return out


def compact_lines(rep: dict, unit: tuple[str, int]) -> list[str]:
    """The table's compact-state rows (text)."""
    rows = rep.get("compact_rows") or []
    if not rows:
        return []
    stage = rows[0]["stage"]
    lines = [
        "",
        f"model states by state dtype and master (ZeRO-{stage}, N = "
        f"{rep['world_size']}; bytes/param = params + grads + master + optimizer):",
    ]
    for r in rows:
        lines.append(
            f"  {r['label']:<40} {r['bytes_per_param']:>8.3f} B/param  "
            f"{r['model_states'] / unit[1]:>10.2f} {unit[0]}/rank"
        )
    return lines
