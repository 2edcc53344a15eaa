"""Numbers and bit patterns as people write them: reading user text, printing exact values.

Reading: `parse_number` turns '0.1', '1e-8', '1/3', '0x1.8p3', 'inf' into the exact value
meant (a Fraction, so "0.1" is one tenth, not the double nearest to it); `parse_bits` reads
a pattern written with spaced fields, ungrouped, or in hex, and works out its format.
Printing: `show` and `exact_decimal` write exact binary fractions in decimal (every
finite float is one), falling back to ≈ forms only where the digits would run on.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from zerotrain.numerics.formats import ALL_FORMATS, FloatFormat, get_format

__all__ = ["approx", "exact_decimal", "is_decimal", "parse_bits", "parse_number", "short", "show"]


# ---- reading -------------------------------------------------------------------------------
_SPECIAL_NUMBERS = {"inf": math.inf, "infinity": math.inf, "nan": math.nan}


def parse_number(text: str) -> Fraction | float:
    """'0.1', '1e-8', '-2.5', '1/3', '0x1.8p3' → exact Fraction; 'inf'/'nan' → float.

    Returns a float only for the specials, or for "-0" (to keep the sign of zero).
    """
    s = text.strip().lower()
    body = s.lstrip("+-")
    negative = s.startswith("-")
    if body in _SPECIAL_NUMBERS:
        v = _SPECIAL_NUMBERS[body]
        return -v if negative else v
    big = re.search(r"e([+-]?\d+)$", body)
    if big and abs(int(big.group(1))) > 100_000:
        raise ValueError(f"{text!r}: decimal exponent beyond ±100000 (every format is ±inf or 0)")
    try:
        if body.startswith("0x"):
            value = Fraction(float.fromhex(s))
        else:
            value = Fraction(s.replace("_", ""))
    except (ValueError, ZeroDivisionError, OverflowError):
        raise ValueError(
            f"cannot read {text!r} as a number (try 9.625, -2.5, 1e-8, 1/3, inf, nan)"
        ) from None
    if value == 0 and negative:
        return -0.0
    return value


_GROUP_SPLIT = re.compile(r"[\s._|]+")


def parse_bits(text: str, fmt: FloatFormat | str | None = None) -> tuple[FloatFormat, int]:
    """Read '0 10000010 0011…', '01000001000110100000000000000000' or '0x411A0000'.

    Grouped fields name their format by widths (1/5/10 is fp16); an ungrouped pattern whose
    length fits several formats (16 bits: fp16 or bf16) needs `fmt`.
    """
    given = get_format(fmt) if fmt is not None else None
    s = text.strip()
    if s.lower().startswith("0x"):
        digits = re.sub(r"[\s_]", "", s[2:])
        if not digits or not re.fullmatch(r"[0-9a-fA-F]+", digits):
            raise ValueError(f"{text!r} is not a hex pattern")
        bits, width = int(digits, 16), 4 * len(digits)
        if given is None:
            matches = [f for f in ALL_FORMATS if (f.total_bits + 3) // 4 * 4 == width]
            given = _pick(matches, f"a {len(digits)}-digit hex pattern", text)
        if bits >> given.total_bits:
            raise ValueError(f"{text!r} does not fit in {given.total_bits}-bit {given.name}")
        return given, bits
    if s.lower().startswith("0b"):
        s = s[2:]
    groups = [g for g in _GROUP_SPLIT.split(s) if g]
    if not groups or any(set(g) - {"0", "1"} for g in groups):
        raise ValueError(f"{text!r} is not a bit pattern: use 0s and 1s, or 0x hex")
    joined = "".join(groups)
    if len(groups) == 3:
        widths = tuple(len(g) for g in groups)
        if widths[0] != 1:
            raise ValueError(f"{text!r}: the first field is the sign and must be 1 bit")
        matches = [f for f in ALL_FORMATS if (f.exponent_bits, f.mantissa_bits) == widths[1:]]
        if given is None:
            if not matches:
                known = ", ".join(
                    f"{f.name} 1/{f.exponent_bits}/{f.mantissa_bits}" for f in ALL_FORMATS
                )
                raise ValueError(f"no format has fields 1/{widths[1]}/{widths[2]} (known: {known})")
            given = matches[0]
        elif (given.exponent_bits, given.mantissa_bits) != widths[1:]:
            raise ValueError(
                f"{text!r} has fields 1/{widths[1]}/{widths[2]} but {given.name} is "
                f"1/{given.exponent_bits}/{given.mantissa_bits}"
            )
    elif len(groups) != 1:
        raise ValueError(f"{text!r}: write the fields as 'S EEEE MMM' (3 groups) or ungrouped")
    elif given is None:
        matches = [f for f in ALL_FORMATS if f.total_bits == len(joined)]
        given = _pick(matches, f"{len(joined)} ungrouped bits", text)
    if len(joined) != given.total_bits:
        raise ValueError(f"{text!r} has {len(joined)} bits but {given.name} has {given.total_bits}")
    return given, int(joined, 2)


def _pick(matches: list[FloatFormat], what: str, text: str) -> FloatFormat:
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"{text!r}: no format matches {what}; pass --format")
    names = " or ".join(f"{f.name} (1/{f.exponent_bits}/{f.mantissa_bits})" for f in matches)
    f = matches[0]
    example = f"0 0{'1' * (f.exponent_bits - 1)} {'0' * f.mantissa_bits}"
    raise ValueError(
        f"{text!r}: {what} could be {names}; group the fields with spaces "
        f"(e.g. '{example}' is 1.0 in {f.name}) or pass --format"
    )


# ---- printing ------------------------------------------------------------------------------
def is_decimal(fr: Fraction) -> bool:
    """Does fr have a finite decimal expansion (denominator = 2^a·5^b)?"""
    d = fr.denominator
    d >>= (d & -d).bit_length() - 1  # drop the factors of 2
    return d == 1 or math.gcd(d, 5 ** d.bit_length()) == d


def exact_decimal(fr: Fraction) -> str:
    """Exact decimal string of a terminating fraction (every dyadic float is one)."""
    sign, fr = ("-" if fr < 0 else ""), abs(fr)
    k = 0
    while (fr * 10**k).denominator != 1:
        k += 1
    digits = str((fr * 10**k).numerator).rjust(k + 1, "0")
    if k == 0:
        return sign + digits
    return f"{sign}{digits[:-k]}.{digits[-k:]}"


def show(fr: Fraction, limit: int = 40) -> str:
    """Exact when short (decimal, scientific or p/q), otherwise ≈ 17 significant digits."""
    if max(fr.numerator.bit_length(), fr.denominator.bit_length()) > 2000:
        return approx(fr)  # e.g. 1e100000: no exact digits, no float conversion
    if is_decimal(fr):
        s = exact_decimal(fr)
        sci = _scientific(fr, s)
        if len(s) <= limit and (len(s) <= 24 or sci is None or len(sci) >= len(s) - 8):
            return s
        if sci is not None:
            return sci
    elif len(str(fr)) <= limit:
        return str(fr)
    return f"≈{float(fr):.17g}" if 1e-300 < abs(_as_float(fr)) < 1e300 else approx(fr)


def approx(fr: Fraction, digits: int = 6) -> str:
    """≈ d.ddddde±N for numbers of any size (floats overflow beyond 1.8e308)."""
    if fr == 0:
        return "0"
    mag = abs(fr)
    exp10 = math.floor(math.log10(mag.numerator) - math.log10(mag.denominator))
    n, d = mag.numerator, mag.denominator
    mant = n / (d * 10**exp10) if exp10 >= 0 else n * 10**-exp10 / d
    return f"≈{'-' if fr < 0 else ''}{mant:.{digits}g}e{exp10}"


def short(fr: Fraction) -> str:
    """3 significant digits, even where a float would overflow or underflow."""
    x = _as_float(fr)
    if fr != 0 and (x == 0 or math.isinf(x)):
        return approx(fr, 3).lstrip("≈")
    return f"{x:.3g}"


def _as_float(fr: Fraction) -> float:
    """float(fr), but ±inf instead of OverflowError for astronomically large values."""
    try:
        return float(fr)
    except OverflowError:
        return math.inf if fr > 0 else -math.inf


def _scientific(fr: Fraction, s: str) -> str | None:
    """Exact scientific notation ('1e-40') when there are few significant digits."""
    digits = s.lstrip("-").replace(".", "").lstrip("0").rstrip("0")
    if not digits or len(digits) > 30:
        return None
    mag = abs(fr)
    exp10 = math.floor(math.log10(mag.numerator) - math.log10(mag.denominator))
    while Fraction(10) ** exp10 > mag:  # guard float rounding of the logs
        exp10 -= 1
    while Fraction(10) ** (exp10 + 1) <= mag:
        exp10 += 1
    mant = f"{digits[0]}.{digits[1:]}" if len(digits) > 1 else digits
    return f"{'-' if fr < 0 else ''}{mant}e{exp10}"
