"""Byte units as people write them: GB = 10^9 bytes (a datasheet's unit), GiB = 2^30.

`parse_size` (in args.py) reads them; the functions here print them, choosing the unit
from the size of the number so small models show MB and large ones GB or TB.
"""

from __future__ import annotations

DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}


def pick_unit(nbytes: float, binary: bool = False) -> tuple[str, int]:
    """The largest unit of the family in which `nbytes` is at least 1 ('B' below 1 KB)."""
    name, factor = "B", 1
    for unit, size in (BINARY if binary else DECIMAL).items():
        if abs(nbytes) >= size:
            name, factor = unit, size
    return name, factor


def format_in(nbytes: float, unit: tuple[str, int]) -> str:
    """'55.56 GB' in the given unit; whole bytes without decimals."""
    name, factor = unit
    return f"{nbytes:.0f} B" if factor == 1 else f"{nbytes / factor:.2f} {name}"


def format_bytes(nbytes: float, binary: bool = False) -> str:
    """A human size in its own best unit."""
    return format_in(nbytes, pick_unit(nbytes, binary))


def table_unit(values: list[float], binary: bool = False, width: int = 4) -> tuple[str, int]:
    """The smallest unit in which every value has at most `width` digits before the point:
    MB for a small model, GB for 7B, still GB (1120.00) where a 70B model meets ZeRO-3."""
    top = max((abs(v) for v in values), default=0)
    for unit in [("B", 1), *(BINARY if binary else DECIMAL).items()]:
        if top < unit[1] * 10**width:
            return unit
    return unit


def unit_words(unit: tuple[str, int]) -> str:
    """'GB (10^9 bytes)', 'MiB (2^20 bytes)', 'B (bytes)'."""
    name, factor = unit
    if factor == 1:
        return f"{name} (bytes)"
    base, exp = (2, factor.bit_length() - 1) if "i" in name else (10, len(str(factor)) - 1)
    return f"{name} ({base}^{exp} bytes)"
