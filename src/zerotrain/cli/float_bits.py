"""A format's bit patterns and the exact values they stand for, as `zerotrain float` shows them.

Split a pattern into its fields, classify it, decode it exactly, round an exact value to
nearest (ties to even) keeping the guard/round/sticky bits a person rounding by hand would
see, encode any real, and write a pattern the way one writes it by hand. The layout
itself, and what the library needs of it (ranges, special patterns, the torch dtype),
is `zerotrain.numerics.formats`; the tensor versions are `zerotrain.numerics.codec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from zerotrain.numerics.formats import FloatFormat, floor_log2

__all__ = ["Rounding", "classify", "decode", "decode_exact", "encode", "fields", "format_bits",
           "hex_bits", "round_exact"]

Number = float | int | Fraction


@dataclass(frozen=True)
class Rounding:
    """How one exact value lands in a format: the pieces a person rounding by hand would see.

    `significand` counts quanta of 2^`quantum_exp` (the weight of the last mantissa bit):
    `truncated` before rounding, `significand` after. guard/round/sticky are the classic
    G/R/S bits just below that last place.
    """

    negative: bool
    exponent: int  # floor(log2 |x|)
    subnormal: bool
    quantum_exp: int
    truncated: int
    guard: int
    round_bit: int
    sticky: int
    rounded_up: bool
    tie: bool
    significand: int
    overflow: bool
    bits: int


def fields(fmt: FloatFormat, bits: int) -> tuple[int, int, int]:
    """Split a pattern into (sign, biased exponent, mantissa)."""
    _check_bits(fmt, bits)
    return (
        bits >> (fmt.total_bits - 1),
        (bits >> fmt.mantissa_bits) & fmt.exponent_mask,
        bits & fmt.mantissa_mask,
    )


def classify(fmt: FloatFormat, bits: int) -> Literal["zero", "subnormal", "normal", "inf", "nan"]:
    _, e, m = fields(fmt, bits)
    if fmt.encoding == "fn":
        if e == fmt.exponent_mask and m == fmt.mantissa_mask:
            return "nan"
    elif e == fmt.exponent_mask:
        return "inf" if m == 0 else "nan"
    if e == 0:
        return "zero" if m == 0 else "subnormal"
    return "normal"


def decode_exact(fmt: FloatFormat, bits: int) -> Fraction | str:
    """Exact value of a pattern; 'inf', '-inf' or 'nan' for the specials.

    -0 decodes to Fraction(0): use `decode` when the sign of zero matters.
    """
    kind = classify(fmt, bits)
    sign, _, _ = fields(fmt, bits)
    if kind == "nan":
        return "nan"
    if kind == "inf":
        return "-inf" if sign else "inf"
    value = fmt.magnitude_exact(bits & (fmt.sign_bit - 1))
    return -value if sign else value


def decode(fmt: FloatFormat, bits: int) -> float:
    """Pattern → Python float (exact: every format here fits in a double)."""
    exact = decode_exact(fmt, bits)
    if isinstance(exact, str):
        return float(exact)
    return math.copysign(float(exact), -1.0 if bits & fmt.sign_bit else 1.0)


def round_exact(fmt: FloatFormat, value: Fraction, negative: bool | None = None) -> Rounding:
    """Round an exact non-zero finite value to nearest, ties to even; keep the G/R/S story."""
    if value == 0:
        raise ValueError("round_exact needs a non-zero value (zero has no exponent)")
    neg = value < 0 if negative is None else negative
    n, d = abs(value.numerator), value.denominator
    exponent = floor_log2(n, d)
    eff = max(exponent, fmt.emin)
    q = eff - fmt.mantissa_bits
    # |x| / 2^q as num/den, with plain ints (no gcd on huge numbers)
    num, den = (n, d << q) if q >= 0 else (n << -q, d)
    truncated, rest = divmod(num, den)  # rest/den in [0, 1): the bits below the last place
    guard = int(2 * rest >= den)
    round_bit = (4 * rest // den) % 2
    sticky = int(4 * rest % den != 0)
    tie = 2 * rest == den
    up = 2 * rest > den or (tie and truncated % 2 == 1)
    sig = truncated + int(up)
    mag_bits = ((eff - fmt.emin) << fmt.mantissa_bits) + sig
    overflow = mag_bits > fmt.max_finite_bits
    if overflow:
        mag_bits = fmt.overflow_bits(neg) & (fmt.sign_bit - 1)
    return Rounding(
        negative=neg,
        exponent=exponent,
        subnormal=exponent < fmt.emin,
        quantum_exp=q,
        truncated=truncated,
        guard=guard,
        round_bit=round_bit,
        sticky=sticky,
        rounded_up=up,
        tie=tie,
        significand=sig,
        overflow=overflow,
        bits=mag_bits | (fmt.sign_bit if neg else 0),
    )


def encode(fmt: FloatFormat, x: Number) -> int:
    """Round any real (float, int or exact Fraction) to a pattern.

    Works from the exact value, so a double is rounded once (no detour through fp32);
    text such as "0.1" goes through `float_notation.parse_number` first, which reads it as
    the real number 1/10, not the double nearest to it.
    """
    if isinstance(x, float):
        negative = math.copysign(1.0, x) < 0
        if math.isnan(x):
            return fmt.nan_bits(negative)
        if math.isinf(x):
            inf = fmt.inf_bits(negative)
            return inf if inf is not None else fmt.overflow_bits(negative)
        if x == 0:
            return fmt.sign_bit if negative else 0
        return round_exact(fmt, Fraction(x), negative).bits
    value = Fraction(x)
    if value == 0:
        return 0
    return round_exact(fmt, value).bits


def format_bits(fmt: FloatFormat, bits: int, sep: str = " ") -> str:
    """'0 10000010 00110100000000000000000': the fields, as one writes them by hand."""
    s, e, m = fields(fmt, bits)
    return sep.join((str(s), f"{e:0{fmt.exponent_bits}b}", f"{m:0{fmt.mantissa_bits}b}"))


def hex_bits(fmt: FloatFormat, bits: int) -> str:
    _check_bits(fmt, bits)
    return f"0x{bits:0{(fmt.total_bits + 3) // 4}X}"


def _check_bits(fmt: FloatFormat, bits: int) -> None:
    if not 0 <= bits < (1 << fmt.total_bits):
        raise ValueError(f"{bits:#x} is not a {fmt.total_bits}-bit {fmt.name} pattern")
