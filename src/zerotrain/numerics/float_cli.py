"""`zerotrain float` and `zerotrain formats`: the command-line side of `explain.py`,
and the comparison table of every format, derived from the layouts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import NoReturn

from zerotrain.numerics.explain import (
    _overflow_text,
    _table,
    explain_all,
    explain_bits,
    explain_encode,
)
from zerotrain.numerics.formats import ALL_FORMATS, FP32, FloatFormat, floor_log2
from zerotrain.numerics.notation import exact_decimal, parse_number

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
        notes.append(_overflow_text(fmt).replace("overflow → ", "overflow "))
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
    return _table(rows) + "\n" + foot


# ---- CLI entry points ----------------------------------------------------------------------
class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _run(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: list[str],
    body: Callable[[argparse.Namespace], str],
) -> int:
    try:
        args = parser.parse_args(argv)
        text = body(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError) as e:
        print(f"{prog}: error: {e}  (see {prog} --help)", file=sys.stderr)
        return 2
    print(text)
    return 0


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


def main_float(argv: list[str]) -> int:
    """`zerotrain float VALUE [--format F|all]` and `zerotrain float --bits PATTERN`."""
    p = _Parser(
        prog="zerotrain float",
        description="Show how a number is stored in a float format, or decode a bit pattern.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  zerotrain float 9.625 --format fp32\n"
        "  zerotrain float 0.1 --format all\n"
        "  zerotrain float -1e-8 -f fp16\n"
        "  zerotrain float --bits '0 10000010 00110100000000000000000'\n"
        "  zerotrain float --bits 0x3c00 --format fp16",
    )
    p.add_argument(
        "value", nargs="?", help="number to encode: 9.625, -2.5, 0.1, 1e-8, 1/3, inf, nan"
    )
    p.add_argument(
        "-f", "--format", help="fp32 (default), tf32, fp16, bf16, fp8-e4m3, fp8-e5m2, all"
    )
    p.add_argument(
        "-b", "--bits", nargs="+", help="decode a pattern: '0 10000010 0011…' or 0x411A0000"
    )

    def body(a: argparse.Namespace) -> str:
        if (a.value is None) == (a.bits is None):
            raise _UsageError("give either a VALUE to encode or --bits PATTERN to decode")
        if a.bits is not None:
            if a.format and a.format.lower() == "all":
                raise _UsageError("--format all works for VALUE only; --bits needs one format")
            return explain_bits(" ".join(a.bits), a.format)
        if a.format and a.format.lower() == "all":
            return explain_all(a.value)
        return explain_encode(a.value, a.format or FP32)

    return _run("zerotrain float", p, _negatives_last(list(argv)), body)


def main_formats(argv: list[str]) -> int:
    """`zerotrain formats [--json]`: every format's range and precision, from its layout."""
    p = _Parser(prog="zerotrain formats", description="Compare the float formats.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return _run(
        "zerotrain formats",
        p,
        list(argv),
        lambda a: json.dumps(format_rows(), indent=2) if a.json else formats_table(),
    )
