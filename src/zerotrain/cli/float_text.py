"""The text of `zerotrain float`: one number in every format, a pattern decoded field by
field, and the pieces the step-by-step encoding (`float_encode.py`) shares with them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from zerotrain.cli.float_bits import (
    classify,
    decode,
    decode_exact,
    encode,
    fields,
    format_bits,
    hex_bits,
    round_exact,
)
from zerotrain.cli.float_notation import (
    exact_decimal,
    is_decimal,
    parse_bits,
    parse_number,
    short,
    show,
)
from zerotrain.numerics.formats import ALL_FORMATS, FloatFormat

__all__ = [
    "TWO",
    "bits_text",
    "explain_all",
    "explain_bits",
    "layout",
    "overflow_text",
    "result_lines",
    "table",
]

TWO = "₂"


# ---- small text helpers --------------------------------------------------------------------
def bits_text(s: str, limit: int = 72) -> str:
    return s if len(s) <= limit else f"{s[:40]}…{s[-16:]}"


def layout(fmt: FloatFormat) -> str:
    return (
        f"1 sign bit, {fmt.exponent_bits} exponent bits, {fmt.mantissa_bits} mantissa bits, "
        f"bias {fmt.bias}"
    )


def overflow_text(fmt: FloatFormat) -> str:
    if fmt.overflow == "inf":
        return "overflow → ±inf"
    if fmt.overflow == "saturate":
        return f"overflow → saturates to ±{show(fmt.max_finite_exact)} (torch's cast)"
    return "overflow → NaN"


def stored_text(fmt: FloatFormat, bits: int) -> str:
    kind = classify(fmt, bits)
    s, e, m = fields(fmt, bits)
    sign = "-" if s else "+"
    if kind in ("inf", "nan", "zero"):
        return {"inf": f"{sign}inf", "nan": "NaN", "zero": f"{sign}0"}[kind]
    mbits = f"{m:0{fmt.mantissa_bits}b}".rstrip("0")
    if kind == "subnormal":
        return f"{sign}0.{mbits}{TWO} × 2^{fmt.emin}"
    return f"{sign}1.{mbits or '0'}{TWO} × 2^{e - fmt.bias}"


def result_lines(fmt: FloatFormat, bits: int, value: Fraction | None) -> list[str]:
    out = [
        "",
        "Result: sign | exponent | mantissa",
        f"   {format_bits(fmt, bits)}   ({hex_bits(fmt, bits)})",
        f"   stored value = {stored_text(fmt, bits)}",
    ]
    if classify(fmt, bits) in ("normal", "subnormal"):
        out[-1] += f" = {decoded(fmt, bits)}"
    stored = decode_exact(fmt, bits)
    if value is None or isinstance(stored, str):
        return out
    err = stored - value
    if err == 0:
        return [*out, f"   exact: {show(value)} is representable in {fmt.name}, error 0"]
    rel = abs(err / value)
    approx = short(err)
    out.append(
        f"   rounding error = stored − x = {show(err)}"
        + (f"  ({approx})" if approx != show(err) else "")
    )
    bound = fmt.epsilon_exact / 2
    if round_exact(fmt, value).overflow:
        note = "overflow: saturated to the largest finite value"
    elif classify(fmt, bits) == "normal" and abs(value) >= fmt.min_normal_exact:
        note = (
            f"≤ ε/2 = 2^-{fmt.mantissa_bits + 1} ≈ {float(bound):.3g}, the round-to-nearest bound"
        )
    elif stored == 0:
        note = "underflow: the whole value is lost"
    elif abs(value) < fmt.min_normal_exact:
        note = (
            "subnormal: fewer significant bits, so only |error| ≤ "
            f"2^{fmt.emin - fmt.mantissa_bits - 1} is guaranteed"
        )
    else:
        note = "overflow"
    return [*out, f"   relative error = {short(rel)}  ({note})"]


def decoded(fmt: FloatFormat, bits: int) -> str:
    exact = decode_exact(fmt, bits)
    if isinstance(exact, str):
        return exact
    text = show(exact, limit=60)
    if not text.startswith("≈"):
        return text
    return f"{exact.numerator}/2^{exact.denominator.bit_length() - 1} ≈ {float(exact)!r}"


# ---- one number in every format ------------------------------------------------------------
def explain_all(text: str) -> str:
    """One row per format: what the same number becomes in each."""
    value = parse_number(text)
    head = f"x = {text.strip()}" + (
        f"  (read exactly as {value})"
        if isinstance(value, Fraction) and not is_decimal(value)
        else ""
    )
    rows = [("format", "pattern", "stored value", "error", "rel error", "note")]
    for fmt in ALL_FORMATS:
        bits = encode(fmt, value)
        stored = decode_exact(fmt, bits)
        kind = classify(fmt, bits)
        if isinstance(value, float) or isinstance(stored, str):
            abs_e = rel_e = "-"
            note = _special_note(fmt, value, kind)
        else:
            err = stored - value
            abs_e = short(err)
            rel_e = short(abs(err / value)) if value else "0"
            note = _note(fmt, value, stored, kind, err)
        shown = repr(decode(fmt, bits))
        rows.append((fmt.name, format_bits(fmt, bits), shown, abs_e, rel_e, note))
    return head + "\n\n" + table(rows)


def _note(fmt: FloatFormat, value: Fraction, stored: Fraction, kind: str, err: Fraction) -> str:
    if value != 0 and round_exact(fmt, value).overflow:
        return f"overflow → saturated to ±{show(fmt.max_finite_exact)}"
    if err == 0:
        return "exact, subnormal" if kind == "subnormal" else "exact"
    if kind == "zero":
        return "rounds to zero (underflow)"
    return "subnormal" if kind == "subnormal" else ""


def _special_note(fmt: FloatFormat, value: Fraction | float, kind: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if kind == "inf" else overflow_text(fmt)
    if isinstance(value, float):
        return "-0"
    return overflow_text(fmt)


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- decoding, step by step ----------------------------------------------------------------
def explain_bits(text: str, fmt: FloatFormat | str | None = None) -> str:
    """Decode a pattern field by field; the format comes from the grouping or `fmt`."""
    given = fmt is not None
    fmt, bits = parse_bits(text, fmt)
    s = fields(fmt, bits)[0]
    how = "given by --format" if given else "inferred from the pattern"
    out = [
        f"{format_bits(fmt, bits)} ({hex_bits(fmt, bits)}) read as {fmt.name} ({how})",
        f"   {layout(fmt)}",
        "",
        f"sign      S = {s} → {'negative' if s else 'positive'}",
    ]
    if classify(fmt, bits) in ("nan", "inf", "zero"):
        return "\n".join(out + _special_fields(fmt, bits))
    return "\n".join(out + _finite_fields(fmt, bits))


def _field_bits(fmt: FloatFormat, bits: int) -> tuple[int, int, str, str]:
    """Sign, biased exponent, and the exponent and mantissa fields as written digits."""
    s, e, m = fields(fmt, bits)
    return s, e, f"{e:0{fmt.exponent_bits}b}", f"{m:0{fmt.mantissa_bits}b}"


def _special_fields(fmt: FloatFormat, bits: int) -> list[str]:
    """Exponent and mantissa of a NaN, an infinity or a zero."""
    s, e, ebits, mbits = _field_bits(fmt, bits)
    kind = classify(fmt, bits)
    if kind == "nan":
        if fmt.encoding == "fn":
            why = f"S.{ebits}.{mbits} is {fmt.name}'s only NaN code (this format has no inf)"
        else:
            why = "exponent all ones, mantissa ≠ 0"
        return [f"exponent  {ebits}{TWO} = {e}", f"mantissa  {mbits}", f"value     NaN: {why}"]
    if kind == "inf":
        return [f"exponent  {ebits}{TWO} = {e}: all ones", f"mantissa  {mbits} = 0",
                f"value     {'-' if s else '+'}infinity"]
    return [f"exponent  {ebits}, mantissa {mbits}: all zero → {'-' if s else '+'}0"]


def _finite_fields(fmt: FloatFormat, bits: int) -> list[str]:
    """Exponent, mantissa as a sum of powers of two, and the value of a (sub)normal number."""
    s, e, ebits, mbits = _field_bits(fmt, bits)
    m = int(mbits, 2)
    if classify(fmt, bits) == "subnormal":
        out = [f"exponent  {ebits}{TWO} = 0 → subnormal: no implicit 1, value = 0.M × "
               f"2^(1−{fmt.bias}) = 0.M × 2^{fmt.emin}"]
        lead, E = 0, fmt.emin
    else:
        E = e - fmt.bias
        top = (" (fn: the all-ones exponent is an ordinary one here)"
               if e == fmt.exponent_mask else "")
        out = [f"exponent  {ebits}{TWO} = {e} → E = {e} − {fmt.bias} = {E}{top}"]
        lead = 1
    terms = [f"2^-{i + 1}" for i, c in enumerate(mbits) if c == "1"]
    decimals = [exact_decimal(Fraction(1, 2 ** (i + 1))) for i, c in enumerate(mbits) if c == "1"]
    sig = lead + Fraction(m, 1 << fmt.mantissa_bits)
    parts = ([str(lead)] if lead else []) + terms
    out.append(f"mantissa  {mbits} → {lead}.M = {' + '.join(parts) or '0'}")
    pad = " " * (len(f"mantissa  {mbits} → {lead}.M"))
    if len(terms) <= 8 and len(parts) > 1:
        out.append(f"{pad} = {' + '.join(([str(lead)] if lead else []) + decimals)}")
    if len(parts) > 1:
        out.append(f"{pad} = {show(sig, limit=60)}")
    out.append(f"value     {'-' if s else '+'}{show(sig, limit=60)} × 2^{E} = {decoded(fmt, bits)}")
    return out
