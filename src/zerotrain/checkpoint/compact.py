"""Compact optimizer states in checkpoints (docs/compact-states.md).

int8 states are saved as they live: `<name>~q8` (uint8 codes, one per element, cut like
any elementwise state) and `<name>~scale` (fp32, one per 256-element block). Every
parameter starts a block and every shard boundary falls between blocks (the int8
layout, `zero.cut.align_for`), so a scale belongs to exactly one parameter and a range
of elements [a, b) has the blocks [a/256, ceil(b/256)): scales are cut again in those
block coordinates, with a layout whose parameters are counted in blocks. bf16 states
keep their dtype. Loading into another optimizer.state_dtype converts
(`optim.compact.convert_state`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerotrain.numerics import blockquant
from zerotrain.numerics.blockquant import BLOCK, n_blocks
from zerotrain.optim.compact import Q8, SCALE, SQRT_STATES

BLOCKS_SUFFIX = SCALE
__all__ = [
    "Q8",
    "block_layout",
    "conversion_notes",
    "dequantizing_reader",
    "is_blocks",
    "saved_dtype",
    "wants_int8",
]


def is_blocks(name: str) -> bool:
    """Whether optimizer state `name` holds one value per block (int8 scales)."""
    return name.endswith(BLOCKS_SUFFIX)


def block_layout(unit: dict) -> dict:
    """A unit's layout (`FlatUnit.layout()`) in block coordinates: each parameter
    ceil(numel/256) blocks long, starting at its offset / 256."""
    params = []
    for name, shape, off, group in unit["params"]:
        if off % BLOCK:
            raise ValueError(
                f"parameter '{name}' does not start a quantisation block; the "
                "checkpoint was not saved with int8 states"
            )
        params.append([name, [n_blocks(math.prod(shape))], off // BLOCK, group])
    return {**unit, "params": params}


def saved_dtype(saved: Any, name: str, params: list[str]) -> torch.dtype | None:
    """The dtype state `name` was saved in, when it is a compact one (uint8 codes, bf16),
    read from one element; None otherwise (the caller's dtype applies)."""
    for p in params:
        try:
            dt = saved.reader(name)(p, 0, 1).dtype
        except Exception:  # this parameter has no such state (another optimizer path)
            continue
        return dt if dt in (torch.uint8, torch.bfloat16) else None
    return None


def wants_int8(template: dict, unit: dict, start: int) -> bool:
    """Whether the running engine (`template`, its state dict) keeps int8 states in a
    block-aligned layout, so saved codes and scales are read as they are."""
    opt = template["meta"]["config"].get("optimizer", {})
    return (
        opt.get("state_dtype") == "int8"
        and start % BLOCK == 0
        and all(p[2] % BLOCK == 0 for p in unit["params"])
    )


def dequantizing_reader(saved: Any, codes_name: str) -> Any:
    """read(param, a, b) of the fp32 values an int8 state (`<name>~q8` and its scales)
    holds, for a run that keeps another state dtype or layout."""
    base = codes_name.removesuffix(Q8)
    codes, scales = saved.reader(codes_name), saved.reader(base + SCALE)
    sqrt = base in SQRT_STATES

    def read(name: str, a: int, b: int) -> torch.Tensor:
        c = codes(name, a, b).reshape(-1)
        s = scales(name, a // BLOCK, n_blocks(b)).reshape(-1).float()
        book = blockquant.book(not sqrt, c.device)[0]
        x = book[c.long()] * s[torch.arange(a, b) // BLOCK - a // BLOCK]
        return x.square() if sqrt else x

    return read


_HOW = {
    ("int8", "fp32"): "dequantised, exactly the values the int8 states held",
    ("int8", "bf16"): "dequantised, then rounded to bf16",
    ("bf16", "fp32"): "widened, exactly",
    ("fp32", "bf16"): "rounded to bf16",
    ("fp32", "int8"): "quantised block-wise (lossy, as every int8 step is)",
    ("bf16", "int8"): "quantised block-wise (lossy, as every int8 step is)",
}


def conversion_notes(saved_config: dict, config: dict) -> list[str]:
    """Lines saying how a checkpoint's compact states were converted for this run."""

    def get(cfg: dict, section: str, key: str, default: Any) -> Any:
        return (cfg.get(section) or {}).get(key) or default

    out = []
    a = get(saved_config, "optimizer", "state_dtype", "fp32")
    b = get(config, "optimizer", "state_dtype", "fp32")
    if a != b:
        out.append(f"[zerotrain] optimizer states converted {a} → {b}: {_HOW[(a, b)]}")
    a = get(saved_config, "precision", "master_update", None)
    b = get(config, "precision", "master_update", None)
    if a == "kahan" and b != "kahan":
        out.append(
            "[zerotrain] the checkpoint's Kahan compensation was dropped (this run's "
            f"master_update is {b or 'none'}): weights continue from their bf16 values"
        )
    elif b == "kahan" and a != "kahan":
        out.append("[zerotrain] Kahan compensation starts at zero (the checkpoint has none)")
    return out
