"""`zerotrain float` and `zerotrain formats`: a number encoded or a pattern decoded (the text
comes from `float_encode.py` and `float_text.py`), and the comparison table of every
format, derived from the layouts."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

from zerotrain.cli.args import Parser, UsageError, command
from zerotrain.cli.float_bits import decode, encode
from zerotrain.cli.float_encode import explain_encode
from zerotrain.cli.float_notation import exact_decimal, parse_number
from zerotrain.cli.float_text import explain_all, explain_bits, overflow_text, table
from zerotrain.numerics.formats import ALL_FORMATS, FP32, FloatFormat, floor_log2, get_format

__all__ = ["format_rows", "formats_table", "main_float", "main_formats"]


# ---- the formats table ---------------------------------------------------------------------
def _pow2(x: Fraction) -> str:
    return f"{float(x):.6g} (2^{floor_log2(x.numerator, x.denominator)})"


def _notes(fmt: FloatFormat) -> list[str]:
    notes = []
    if fmt.encoding == "fn":
        nan = "S." + "1" * fmt.exponent_bits + "." + "1" * fmt.mantissa_bits
        notes.append(f"no inf; NaN = {nan}")
    if fmt.overflow != "inf":
        notes.append(overflow_text(fmt).replace("overflow → ", "overflow "))
    if fmt is not FP32 and (fmt.exponent_bits, fmt.bias) == (FP32.exponent_bits, FP32.bias):
        notes.append("same range as fp32")
    if fmt.torch_dtype_name is None:
        notes.append("no torch dtype")
    return notes


def format_rows() -> list[dict[str, object]]:
    """Every format's derived properties (floats plus exact strings), for the table and JSON."""
    rows: list[dict[str, object]] = []
    for f in ALL_FORMATS:
        rows.append(
            {
                "name": f.name,
                "aliases": list(f.aliases),
                "bits": f.total_bits,
                "sign_bits": 1,
                "exponent_bits": f.exponent_bits,
                "mantissa_bits": f.mantissa_bits,
                "bias": f.bias,
                "max_finite": f.max_finite,
                "min_normal": f.min_normal,
                "min_subnormal": f.min_subnormal,
                "epsilon": f.epsilon,
                "decimal_digits": round(f.decimal_digits, 3),
                "max_finite_exact": exact_decimal(f.max_finite_exact),
                "min_normal_exact": f"2^{f.emin}",
                "min_subnormal_exact": f"2^{f.emin - f.mantissa_bits}",
                "epsilon_exact": f"2^-{f.mantissa_bits}",
                "has_inf": f.has_inf,
                "overflow": f.overflow,
                "torch_dtype": f.torch_dtype_name,
                "notes": "; ".join([f.description, *_notes(f)]),
            }
        )
    return rows


def formats_table() -> str:
    """The comparison table of `zerotrain formats`, every number computed from the layout."""
    head = ("name", "bits (s/e/m)", "bias", "max finite", "min normal", "min subnormal",
            "epsilon", "~digits", "notes")  # fmt: skip
    rows = [head]
    for f in ALL_FORMATS:
        rows.append(
            (
                f.name,
                f"{f.total_bits} (1/{f.exponent_bits}/{f.mantissa_bits})",
                str(f.bias),
                f"{f.max_finite:.6g}",
                _pow2(f.min_normal_exact),
                _pow2(f.min_subnormal_exact),
                _pow2(f.epsilon_exact),
                f"{f.decimal_digits:.2f}",
                "; ".join(_notes(f)) or "-",
            )
        )
    foot = (
        "\nmax finite = (2 − 2^-m)·2^emax (fn formats: (2 − 2^(1−m))·2^emax);"
        " min normal = 2^(1−bias);\nmin subnormal = 2^(1−bias−m); epsilon = 2^-m;"
        " ~digits = (m+1)·log10 2."
    )
    return table(rows) + "\n" + foot


# ---- CLI entry points ----------------------------------------------------------------------
def _negatives_last(argv: list[str]) -> list[str]:
    """argparse mistakes '-1e-8' or '-inf' for options: move such numbers after '--'."""
    kept, numbers, it = [], [], iter(argv)
    for tok in it:
        if tok in ("-f", "--format", "-b", "--bits"):
            kept += [tok, next(it, "")]
        elif tok == "--":
            numbers += list(it)
        elif tok.startswith("-") and not tok.startswith("--"):
            try:
                parse_number(tok)
                numbers.append(tok)
            except ValueError:
                kept.append(tok)
        else:
            kept.append(tok)
    return [*kept, "--", *numbers] if numbers else kept


def _float_parser() -> Parser:
    p = Parser(
        "float",
        "Show how a number is stored in a float format, step by step, or decode a bit "
        "pattern. Background: docs/design.md §formats.",
        epilog="examples:\n"
        "  zerotrain float 9.625 --format fp32\n"
        "  zerotrain float 0.1 --format all\n"
        "  zerotrain float -1e-8 -f fp16\n"
        "  zerotrain float --bits '0 10000010 00110100000000000000000'\n"
        "  zerotrain float --bits 0x3c00 --format fp16\n"
        "  zerotrain float 1000 --format fp8-e4m3 --amax 3000   (FP8 training's scaling)",
    )
    p.add_argument(
        "value", nargs="?", help="number to encode: 9.625, -2.5, 0.1, 1e-8, 1/3, inf, nan"
    )
    p.add_argument("-f", "--format", help="fp32 (the default), tf32, fp16, bf16, fp8-e4m3, "
                   "fp8-e5m2, or all (one row per format)")
    p.add_argument(
        "-b", "--bits", nargs="+", help="decode a pattern: '0 10000010 0011…' or 0x411A0000"
    )
    p.add_argument("--scale", help="store VALUE × SCALE, as FP8 training does, and show "
                   "what unscaling gives back (e.g. 0.125, 1/8)")
    p.add_argument("--amax", help="the scale FP8 training would use for a tensor whose "
                   "largest magnitude is AMAX: the largest power of two with AMAX × scale "
                   "≤ the format's max (docs/design.md §fp8)")
    return p


def scale_for(fmt: FloatFormat, amax: Fraction) -> Fraction:
    """The power-of-two scale of zerotrain's FP8 recipes: amax·scale ≤ max, as large as
    possible (numerics.fp8.scale_from_amax, exactly)."""
    if amax <= 0:
        raise UsageError("--amax must be a positive number")
    k = floor_log2((fmt.max_finite_exact / amax).numerator, (fmt.max_finite_exact / amax)
                   .denominator)
    return Fraction(2) ** k


def _scaled_text(a: argparse.Namespace) -> str:
    """VALUE × scale encoded in the format, then unscaled: the round trip of an FP8 layer."""
    if a.bits is not None or a.value is None:
        raise UsageError("--scale/--amax apply to a VALUE to encode")
    fmt = get_format(a.format or "fp8-e4m3")
    x = parse_number(a.value)
    if not isinstance(x, Fraction):
        raise UsageError("--scale/--amax need a finite VALUE")
    if a.amax is not None:
        amax = parse_number(a.amax)
        scale = scale_for(fmt, Fraction(amax) if not isinstance(amax, float) else amax)
        how = f"largest power of two with amax {a.amax} × scale ≤ max {fmt.max_finite:g}"
    else:
        scale = Fraction(parse_number(a.scale))
        how = "given"
    scaled = x * scale
    stored = decode(fmt, encode(fmt, scaled))
    back = Fraction(stored) / scale if stored == stored and abs(stored) != float("inf") \
        else None
    lines = [f"scale {exact_decimal(scale)} ({how}); {a.value} × scale = "
             f"{exact_decimal(scaled)} is what gets encoded:", "",
             explain_encode(exact_decimal(scaled), fmt), "",
             "unscaled: stored value / scale = "
             + (f"{exact_decimal(back)} (error {float(back - x):.3g}, relative "
                f"{float((back - x) / x) if x else 0.0:.3g})" if back is not None
                else "not finite")]
    return "\n".join(lines)


def _float_text(a: argparse.Namespace) -> str:
    if a.scale is not None or a.amax is not None:
        return _scaled_text(a)
    every = bool(a.format) and a.format.lower() == "all"
    if (a.value is None) == (a.bits is None):
        raise UsageError("give either a VALUE to encode or --bits PATTERN to decode")
    if a.bits is not None:
        if every:
            raise UsageError("--format all works for VALUE only; --bits needs one format")
        return explain_bits(" ".join(a.bits), a.format)
    return explain_all(a.value) if every else explain_encode(a.value, a.format or FP32)


@command("float")
def main_float(argv: list[str]) -> int:
    """`zerotrain float VALUE [--format F|all]` and `zerotrain float --bits PATTERN`."""
    args = _float_parser().parse_args(_negatives_last(argv))
    try:
        text = _float_text(args)
    except ValueError as e:  # unreadable number or pattern, unknown format
        raise UsageError(str(e)) from None
    print(text)
    return 0


@command("formats")
def main_formats(argv: list[str]) -> int:
    """`zerotrain formats [--json]`: every format's range and precision, from its layout."""
    p = Parser("formats", "Compare the float formats: range and precision, each derived from "
               "the layout (sign, exponent and mantissa bits). See docs/design.md §formats.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    print(json.dumps(format_rows(), indent=2) if a.json else formats_table())
    return 0
