"""`zerotrain float VALUE`: a number encoded the way one does it by hand, one heading at a time.

The derivation (division, repeated doubling, normalising, G/R/S rounding) is computed here
independently of `float_bits.encode` and then checked against it, so the printed steps can
never drift from the real rounding. Each numbered heading of the output is one function
below, reading and extending one `_Work` record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from zerotrain.cli.float_bits import encode
from zerotrain.cli.float_notation import is_decimal, parse_number, show
from zerotrain.cli.float_text import TWO, bits_text, layout, overflow_text, result_lines
from zerotrain.numerics.formats import FP32, FloatFormat, floor_log2, get_format

__all__ = ["explain_encode"]


@dataclass
class _Work:
    """One number on its way into `fmt`: what the headings so far have worked out."""

    fmt: FloatFormat
    value: Fraction
    ex: int  # floor(log2 |x|)
    ibits: str = ""  # integer part in binary
    fbits: str = ""  # fraction bits written out by the doublings
    rest: Fraction = Fraction(0)  # what is left of the fraction after them (≠ 0: inexact)

    @property
    def mag(self) -> Fraction:
        return abs(self.value)

    @property
    def eff(self) -> int:  # exponent of the leading mantissa place (subnormals: emin)
        return max(self.ex, self.fmt.emin)

    @property
    def q(self) -> int:  # weight 2^q of the last mantissa bit
        return self.eff - self.fmt.mantissa_bits

    @property
    def tail(self) -> str:
        return "…" if self.rest else ""

    def bit(self, p: int) -> int:
        """The binary digit of weight 2^p (0 beyond what was written out)."""
        if p >= 0:
            return int(self.ibits[len(self.ibits) - 1 - p]) if p < len(self.ibits) else 0
        return int(self.fbits[-p - 1]) if -p - 1 < len(self.fbits) else 0

    def point_form(self) -> str:
        """'1001.101₂', with the point dropped when nothing follows it."""
        text = f"{bits_text(self.ibits or '0')}.{bits_text(self.fbits)}{self.tail}{TWO}"
        return text.replace(f".{TWO}", TWO)


def explain_encode(text: str, fmt: FloatFormat | str = FP32) -> str:
    """The hand derivation of `text` → `fmt` bits; raises ValueError on unreadable input."""
    fmt = get_format(fmt)
    value = parse_number(text)
    out = [f"{text.strip()} → {fmt.name} ({layout(fmt)})", ""]
    if isinstance(value, float):  # ±inf, NaN, -0.0
        return "\n".join(out + _special(value, fmt))
    if value == 0:
        out.append("0 has no leading 1 to normalise: it is the all-zeros pattern.")
        return "\n".join(out + result_lines(fmt, 0, value))
    w = _Work(fmt, value, floor_log2(abs(value).numerator, abs(value).denominator))
    out += _sign(w)
    if w.ex > fmt.emax + 64 or w.ex < fmt.emin - fmt.mantissa_bits - 64:
        return "\n".join(out + _far_out(w) + result_lines(fmt, encode(fmt, value), value))
    out += _integer_part(w) + _fraction_part(w) + _binary_form(w) + _normalise(w)
    if w.ex > fmt.emax:
        return "\n".join(out + result_lines(fmt, encode(fmt, value), value))
    out += _exponent(w)
    lines, sig, up = _mantissa(w)
    more, bits = _assemble(w, sig, up)
    if bits != encode(fmt, value):  # the derivation must agree with the real encoder
        raise AssertionError(f"derivation gave {bits:#x}, encode gives {encode(fmt, value):#x}")
    return "\n".join(out + lines + more + result_lines(fmt, bits, value))


# ---- the headings, in the order they are printed -------------------------------------------
def _sign(w: _Work) -> list[str]:
    out = []
    if not is_decimal(w.mag):
        out += [f"(read exactly as the fraction {w.mag}, not as a rounded decimal)", ""]
    neg = w.value < 0
    out += ["1. Sign", f"   {show(w.value)} is {'negative → S = 1' if neg else 'positive → S = 0'}"]
    if neg:
        out.append(f"   continue with |x| = {show(w.mag)}")
    return out


def _far_out(w: _Work) -> list[str]:
    """No point writing out thousands of bits for a value far outside the format."""
    where = "above the largest" if w.ex > 0 else "below the smallest"
    what = overflow_text(w.fmt) if w.ex > 0 else "rounds to zero: underflow"
    return ["", f"2. |x| lies between 2^{w.ex} and 2^{w.ex + 1}: far {where} {w.fmt.name} number",
            f"   ({what})"]


def _integer_part(w: _Work) -> list[str]:
    whole = w.mag.numerator // w.mag.denominator
    if not whole:
        return ["", "2. Integer part: 0"]
    w.ibits = bin(whole)[2:]
    return ["", f"2. Integer part {show(Fraction(whole))} in binary (÷ 2, remainders read "
                "bottom-up)", *_divisions(whole),
            f"   → {show(Fraction(whole))} = {bits_text(w.ibits)}{TWO}"]


def _fraction_part(w: _Work) -> list[str]:
    frac = w.mag - w.mag.numerator // w.mag.denominator
    # double down to the round bit 2^(q-2), and at least to the first 1 of a pure fraction
    need = max(0, 2 - w.q, 0 if w.ibits else -w.ex)
    if frac:
        out = ["", f"3. Fraction part {show(frac)} in binary (double, take the integer part)"]
    else:
        out = ["", "3. Fraction part: 0 (nothing after the binary point)"]
    w.fbits, w.rest, lines = _doublings(frac, need, first_one=0 if w.ibits else -w.ex)
    out += lines
    if w.rest == 0:
        if w.fbits:
            out.append("   the fraction reached 0: the binary expansion ends (exact)")
    elif need == 0:
        out.append(f"   no doubling needed: the integer part already supplies the "
                   f"{w.fmt.mantissa_bits} mantissa bits plus guard and round; a non-zero "
                   "fraction only sets the sticky bit")
    else:
        out.append(f"   stop: we have every bit down to the round bit 2^{w.q - 2}; the rest "
                   "(≠ 0) only sets the sticky bit — the expansion goes on")
    return out


def _binary_form(w: _Work) -> list[str]:
    return ["", "4. Binary form", f"   {show(w.mag)} = {w.point_form()}"]


def _normalise(w: _Work) -> list[str]:
    digits = (w.ibits + w.fbits).lstrip("0")
    places = f"{abs(w.ex)} place{'s' if abs(w.ex) != 1 else ''}"
    move = f"{places} left" if w.ex > 0 else f"{places} right" if w.ex < 0 else "not moved"
    normal = f"1.{bits_text(digits[1:])}{w.tail}{TWO}".replace(f".{TWO}", TWO)
    out = ["", "5. Normalise to 1.M × 2^E",
           f"   {w.point_form()} = {normal} × 2^{w.ex}   (binary point moved {move})"]
    if w.ex > w.fmt.emax:
        out.append(f"   E = {w.ex} > {w.fmt.emax}, the largest exponent of {w.fmt.name}: "
                   f"{overflow_text(w.fmt)}")
    return out


def _kept(w: _Work) -> str:
    """The mantissa field's bits before rounding."""
    return "".join(str(w.bit(p)) for p in range(w.eff - 1, w.q - 1, -1))


def _grs(w: _Work) -> tuple[int, int, int]:
    """Guard, round and sticky: the bits just below the last place, and all the rest."""
    below = any(w.bit(p) for p in range(w.q - 3, -len(w.fbits) - 1, -1))
    return w.bit(w.q - 1), w.bit(w.q - 2), int(w.rest != 0 or below)


def _exponent(w: _Work) -> list[str]:
    fmt, emin = w.fmt, w.fmt.emin
    if w.ex < emin:
        inexact = "…" if any(_grs(w)) else ""
        return ["", "6. Exponent",
                f"   E = {w.ex} < {emin} = 1 − {fmt.bias}, the smallest normal exponent: "
                "subnormal.",
                f"   Subnormals store 0.M × 2^{emin} with exponent field 0:",
                f"   x = 0.{_kept(w)}{inexact}{TWO} × 2^{emin}"]
    biased = w.ex + fmt.bias
    return ["", "6. Exponent", f"   biased exponent = {w.ex} + {fmt.bias} = {biased} = "
                               f"{biased:0{fmt.exponent_bits}b}{TWO}"]


def _mantissa(w: _Work) -> tuple[list[str], int, bool]:
    """The mantissa bits and the round-to-nearest-even decision: (lines, significand, up)."""
    m, kept = w.fmt.mantissa_bits, _kept(w)
    g, r, s = _grs(w)
    implicit = "" if w.ex < w.fmt.emin else ", the leading 1 is implicit"
    out = ["", f"7. Mantissa ({m} bits{implicit})"]
    if not (g or r or s):
        digits = (w.ibits + w.fbits).lstrip("0")
        shown = min(m, len(digits) - 1) if w.ex >= w.fmt.emin else m
        if shown < m:
            pad = f"{kept[:shown] or '(none)'} + {m - shown} zeros of padding → {kept}"
            out.append(f"   bits after the point: {pad}")
        else:
            out.append(f"   bits after the point: {kept}")
        out.append("   every bit below the last place is 0: exact, no rounding")
        return out, int(kept, 2), False
    out.append(f"   first {m} bits: {kept} | guard G = {g}, round R = {r}, sticky S = {s}")
    sig = int(kept, 2)
    if not g:
        up, why = False, "G = 0: less than half a last-place unit → round down (truncate)"
    elif r or s:
        up, why = True, "G = 1 and R|S = 1: more than half a unit → round up (+1 ulp)"
    else:
        up = sig % 2 == 1
        why = "G = 1, R = S = 0: exactly halfway → ties-to-even: last bit is " + (
            "1 (odd) → round up" if up else "0 (even) → keep")
    out.append(f"   {why}  [1 ulp = 2^{w.q}]")
    return out, sig + int(up), up


def _assemble(w: _Work, sig: int, up: bool) -> tuple[list[str], int]:
    """Carry, the NaN code of fn formats, overflow: the final pattern and what happened."""
    fmt, m, out = w.fmt, w.fmt.mantissa_bits, []
    efield = 0 if w.ex < fmt.emin else w.ex + fmt.bias
    if sig >> m:  # carry out of the mantissa field
        sig, efield = sig - (1 << m), efield + 1
        out.append("   the carry ripples out of the mantissa: " + (
            f"the result becomes the smallest normal 2^{fmt.emin}" if w.ex < fmt.emin
            else f"mantissa 0, exponent +1 → {efield} = {efield:0{fmt.exponent_bits}b}{TWO}"))
    if up and not (sig == 0 and efield):
        out.append(f"   mantissa after rounding: {sig:0{m}b}")
    mag_bits = (efield << m) | sig
    if fmt.encoding == "fn" and efield == fmt.exponent_mask and sig == fmt.mantissa_mask:
        out.append(f"   but S.{efield:b}.{sig:b} is {fmt.name}'s NaN code, so this is past the "
                   "largest finite number")
    if mag_bits > fmt.max_finite_bits:
        out.append(f"   the rounded value exceeds max finite {show(fmt.max_finite_exact)}: "
                   + overflow_text(fmt))
        return out, encode(fmt, w.value)
    if mag_bits == 0:
        out.append("   all bits are 0: the value underflows to zero")
    return out, mag_bits | (fmt.sign_bit if w.value < 0 else 0)


# ---- the written-out arithmetic ------------------------------------------------------------
def _divisions(n: int) -> list[str]:
    lines = []
    while n:
        lines.append(f"   {show(Fraction(n))} ÷ 2 = {show(Fraction(n // 2))} remainder {n % 2}")
        n //= 2
    if len(lines) > 16:
        lines = [*lines[:6], f"   ⋮  ({len(lines) - 10} more divisions)", *lines[-4:]]
    return lines


def _doublings(frac: Fraction, need: int, first_one: int) -> tuple[str, Fraction, list[str]]:
    """Repeated doubling, one line per step; long runs of leading zeros are elided."""
    bits, lines, seen = [], [], {frac: 0}
    skip_to = min(first_one, need) - 2 if min(first_one, need) > 12 else 0
    repeat_noted = False
    for k in range(1, need + 1):
        if frac == 0:
            break
        doubled = frac * 2
        b = int(doubled >= 1)
        bits.append(str(b))
        new = doubled - b
        if k <= 3 or k > skip_to:
            lines.append(f"   {show(frac)} × 2 = {show(doubled)} → {b}")
        elif k == 4:
            lines.append(f"   ⋮  (steps 4–{skip_to} also give 0: the value is below 2^-{skip_to})")
        frac = new
        if frac and frac in seen and not repeat_noted:
            j = seen[frac]
            when = f"after step {j}" if j else "at the start"
            lines.append(f"   (fraction {show(frac)} again, as {when}: the bits "
                         f"{''.join(bits[j:])} repeat forever)")
            repeat_noted = True
        seen.setdefault(frac, k)
    return "".join(bits), frac, lines


def _special(value: float, fmt: FloatFormat) -> list[str]:
    bits = encode(fmt, value)
    if math.isnan(value):
        fn = " (fn format: only S.1…1.1…1 is NaN)" if fmt.encoding == "fn" else ""
        lines = [f"NaN is stored as exponent all ones with a non-zero mantissa{fn}"]
    elif math.isinf(value):
        lines = (["infinity is stored as exponent all ones, mantissa 0"] if fmt.has_inf
                 else [f"{fmt.name} has no infinity: " + overflow_text(fmt)])
    else:
        lines = ["-0 is zero with the sign bit set"]
    return lines + result_lines(fmt, bits, None)
