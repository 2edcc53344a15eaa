"""Number formats worked out the way one does by hand (behind `zerotrain float`).

The derivation (division, repeated doubling, normalising, G/R/S rounding) is computed here
independently of `FloatFormat.encode` and then checked against it, so the printed steps can
never drift from the real rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from zerotrain.numerics.formats import ALL_FORMATS, FP32, FloatFormat, floor_log2, get_format
from zerotrain.numerics.notation import (
    exact_decimal,
    is_decimal,
    parse_bits,
    parse_number,
    short,
    show,
)

__all__ = ["explain_all", "explain_bits", "explain_encode"]

TWO = "₂"


# ---- small text helpers --------------------------------------------------------------------
def _bits(s: str, limit: int = 72) -> str:
    return s if len(s) <= limit else f"{s[:40]}…{s[-16:]}"


def _layout(fmt: FloatFormat) -> str:
    return (
        f"1 sign bit, {fmt.exponent_bits} exponent bits, {fmt.mantissa_bits} mantissa bits, "
        f"bias {fmt.bias}"
    )


def _overflow_text(fmt: FloatFormat) -> str:
    if fmt.overflow == "inf":
        return "overflow → ±inf"
    if fmt.overflow == "saturate":
        return f"overflow → saturates to ±{show(fmt.max_finite_exact)} (torch's cast)"
    return "overflow → NaN"


def _stored_text(fmt: FloatFormat, bits: int) -> str:
    kind = fmt.classify(bits)
    s, e, m = fmt.fields(bits)
    sign = "-" if s else "+"
    if kind in ("inf", "nan", "zero"):
        return {"inf": f"{sign}inf", "nan": "NaN", "zero": f"{sign}0"}[kind]
    mbits = f"{m:0{fmt.mantissa_bits}b}".rstrip("0")
    if kind == "subnormal":
        return f"{sign}0.{mbits}{TWO} × 2^{fmt.emin}"
    return f"{sign}1.{mbits or '0'}{TWO} × 2^{e - fmt.bias}"


# ---- encoding, step by step ----------------------------------------------------------------
def explain_encode(text: str, fmt: FloatFormat | str = FP32) -> str:
    """The hand derivation of `text` → `fmt` bits; raises ValueError on unreadable input."""
    fmt = get_format(fmt)
    value = parse_number(text)
    out = [f"{text.strip()} → {fmt.name} ({_layout(fmt)})", ""]
    if isinstance(value, float):  # ±inf, NaN, -0.0
        return "\n".join(out + _explain_special(value, fmt))
    if value == 0:
        bits = 0
        out.append("0 has no leading 1 to normalise: it is the all-zeros pattern.")
        return "\n".join(out + _result(fmt, bits, value))
    neg, mag = value < 0, abs(value)
    m, emin = fmt.mantissa_bits, fmt.emin
    if not is_decimal(mag):
        out += [f"(read exactly as the fraction {mag}, not as a rounded decimal)", ""]
    out += ["1. Sign", f"   {show(value)} is {'negative → S = 1' if neg else 'positive → S = 0'}"]
    if neg:
        out.append(f"   continue with |x| = {show(mag)}")

    ex = floor_log2(mag.numerator, mag.denominator)
    if ex > fmt.emax + 64 or ex < fmt.emin - m - 64:  # no point writing out thousands of bits
        where = "above the largest" if ex > 0 else "below the smallest"
        out += [
            "",
            f"2. |x| lies between 2^{ex} and 2^{ex + 1}: far {where} {fmt.name} number",
            "   (" + (_overflow_text(fmt) if ex > 0 else "rounds to zero: underflow") + ")",
        ]
        return "\n".join(out + _result(fmt, fmt.encode(value), value))

    whole, frac = mag.numerator // mag.denominator, mag - mag.numerator // mag.denominator
    ibits = bin(whole)[2:] if whole else ""
    if whole:
        out += [
            "",
            f"2. Integer part {show(Fraction(whole))} in binary (÷ 2, remainders read bottom-up)",
        ]
        out += [
            *_divisions(whole),
            f"   → {show(Fraction(whole))} = {_bits(ibits)}{TWO}",
        ]
    else:
        out += ["", "2. Integer part: 0"]

    eff = max(ex, emin)
    q = eff - m  # weight 2^q of the last mantissa bit
    need = max(0, 2 - q, 0 if whole else -ex)  # down to the round bit 2^(q-2) and the first 1
    if frac:
        out += ["", f"3. Fraction part {show(frac)} in binary (double, take the integer part)"]
    else:
        out += ["", "3. Fraction part: 0 (nothing after the binary point)"]
    fbits, frac, lines = _doublings(frac, need, first_one=-ex if not whole else 0)
    out += lines
    if frac == 0:
        if fbits:
            out.append("   the fraction reached 0: the binary expansion ends (exact)")
    elif need == 0:
        out.append(
            f"   no doubling needed: the integer part already supplies the {m} mantissa bits"
            " plus guard and round; a non-zero fraction only sets the sticky bit"
        )
    else:
        out.append(
            f"   stop: we have every bit down to the round bit 2^{q - 2}; the rest (≠ 0) only"
            " sets the sticky bit — the expansion goes on"
        )
    tail = "…" if frac else ""
    out += [
        "",
        "4. Binary form",
        f"   {show(mag)} = {_bits(ibits or '0')}.{_bits(fbits)}{tail}{TWO}",
    ]
    out[-1] = out[-1].replace(f".{TWO}", TWO)

    def bit(p: int) -> int:
        if p >= 0:
            return int(ibits[len(ibits) - 1 - p]) if p < len(ibits) else 0
        return int(fbits[-p - 1]) if -p - 1 < len(fbits) else 0

    digits = (ibits + fbits).lstrip("0")
    places = f"{abs(ex)} place{'s' if abs(ex) != 1 else ''}"
    move = f"{places} left" if ex > 0 else f"{places} right" if ex < 0 else "not moved"
    out += [
        "",
        "5. Normalise to 1.M × 2^E",
        f"   {_bits(ibits or '0')}.{_bits(fbits)}{tail}{TWO} = 1.{_bits(digits[1:])}{tail}{TWO}"
        f" × 2^{ex}   (binary point moved {move})".replace(f".{TWO}", TWO),
    ]
    if ex > fmt.emax:
        out += [
            f"   E = {ex} > {fmt.emax}, the largest exponent of {fmt.name}: {_overflow_text(fmt)}"
        ]
        bits = fmt.encode(value)
        return "\n".join(out + _result(fmt, bits, value))
    kept = "".join(str(bit(p)) for p in range(eff - 1, q - 1, -1))
    g, r = bit(q - 1), bit(q - 2)
    s = int(frac != 0 or any(bit(p) for p in range(q - 3, -len(fbits) - 1, -1)))
    out += ["", "6. Exponent"]
    if ex < emin:
        out += [
            f"   E = {ex} < {emin} = 1 − {fmt.bias}, the smallest normal exponent: subnormal.",
            f"   Subnormals store 0.M × 2^{emin} with exponent field 0:",
            f"   x = 0.{kept}{'…' if g or r or s else ''}{TWO} × 2^{emin}",
        ]
    else:
        out.append(
            f"   biased exponent = {ex} + {fmt.bias} = {ex + fmt.bias} = "
            f"{ex + fmt.bias:0{fmt.exponent_bits}b}{TWO}"
        )
    out += ["", f"7. Mantissa ({m} bits{'' if ex < emin else ', the leading 1 is implicit'})"]
    if not (g or r or s):
        shown = min(m, len(digits) - 1) if ex >= emin else m
        if shown < m:
            pad = f"{kept[:shown] or '(none)'} + {m - shown} zeros of padding → {kept}"
            out.append(f"   bits after the point: {pad}")
        else:
            out.append(f"   bits after the point: {kept}")
        out.append("   every bit below the last place is 0: exact, no rounding")
        sig, up = int(kept, 2), False
    else:
        out.append(f"   first {m} bits: {kept} | guard G = {g}, round R = {r}, sticky S = {s}")
        sig = int(kept, 2)
        if not g:
            up, why = False, "G = 0: less than half a last-place unit → round down (truncate)"
        elif r or s:
            up, why = True, "G = 1 and R|S = 1: more than half a unit → round up (+1 ulp)"
        else:
            up = sig % 2 == 1
            why = "G = 1, R = S = 0: exactly halfway → ties-to-even: last bit is " + (
                "1 (odd) → round up" if up else "0 (even) → keep"
            )
        out.append(f"   {why}  [1 ulp = 2^{q}]")
        sig += int(up)
    efield = 0 if ex < emin else ex + fmt.bias
    if sig >> m:  # carry out of the mantissa field
        sig, efield = sig - (1 << m), efield + 1
        out.append(
            "   the carry ripples out of the mantissa: "
            + (
                f"the result becomes the smallest normal 2^{emin}"
                if ex < emin
                else f"mantissa 0, exponent +1 → {efield} = {efield:0{fmt.exponent_bits}b}{TWO}"
            )
        )
    if up and not (sig == 0 and efield):
        out.append(f"   mantissa after rounding: {sig:0{m}b}")
    mag_bits = (efield << m) | sig
    if fmt.encoding == "fn" and efield == fmt.exponent_mask and sig == fmt.mantissa_mask:
        out.append(
            f"   but S.{efield:b}.{sig:b} is {fmt.name}'s NaN code, so this is past the largest"
            " finite number"
        )
    if mag_bits > fmt.max_finite_bits:
        out.append(f"   the rounded value exceeds max finite {show(fmt.max_finite_exact)}: "
                   + _overflow_text(fmt))  # fmt: skip
        bits = fmt.encode(value)
    else:
        if mag_bits == 0:
            out.append("   all bits are 0: the value underflows to zero")
        bits = mag_bits | (fmt.sign_bit if neg else 0)
    if bits != fmt.encode(value):  # the derivation must agree with the real encoder
        raise AssertionError(f"derivation gave {bits:#x}, encode gives {fmt.encode(value):#x}")
    return "\n".join(out + _result(fmt, bits, value))


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
            lines.append(
                f"   (fraction {show(frac)} again, as {when}: the bits "
                f"{''.join(bits[j:])} repeat forever)"
            )
            repeat_noted = True
        seen.setdefault(frac, k)
    return "".join(bits), frac, lines


def _explain_special(value: float, fmt: FloatFormat) -> list[str]:
    bits = fmt.encode(value)
    if math.isnan(value):
        lines = [
            "NaN is stored as exponent all ones with a non-zero mantissa"
            + (" (fn format: only S.1…1.1…1 is NaN)" if fmt.encoding == "fn" else "")
        ]
    elif math.isinf(value):
        lines = (
            ["infinity is stored as exponent all ones, mantissa 0"]
            if fmt.has_inf
            else [f"{fmt.name} has no infinity: " + _overflow_text(fmt)]
        )
    else:
        lines = ["-0 is zero with the sign bit set"]
    return lines + _result(fmt, bits, None)


def _result(fmt: FloatFormat, bits: int, value: Fraction | None) -> list[str]:
    out = [
        "",
        "Result: sign | exponent | mantissa",
        f"   {fmt.format_bits(bits)}   ({fmt.hex_bits(bits)})",
        f"   stored value = {_stored_text(fmt, bits)}",
    ]
    if fmt.classify(bits) in ("normal", "subnormal"):
        out[-1] += f" = {_decoded(fmt, bits)}"
    stored = fmt.decode_exact(bits)
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
    if fmt.round_exact(value).overflow:
        note = "overflow: saturated to the largest finite value"
    elif fmt.classify(bits) == "normal" and abs(value) >= fmt.min_normal_exact:
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


def _decoded(fmt: FloatFormat, bits: int) -> str:
    exact = fmt.decode_exact(bits)
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
        bits = fmt.encode(value)
        stored = fmt.decode_exact(bits)
        kind = fmt.classify(bits)
        if isinstance(value, float) or isinstance(stored, str):
            abs_e = rel_e = "-"
            note = _special_note(fmt, value, kind)
        else:
            err = stored - value
            abs_e = short(err)
            rel_e = short(abs(err / value)) if value else "0"
            note = _note(fmt, value, stored, kind, err)
        shown = repr(fmt.decode(bits))
        rows.append((fmt.name, fmt.format_bits(bits), shown, abs_e, rel_e, note))
    return head + "\n\n" + _table(rows)


def _note(fmt: FloatFormat, value: Fraction, stored: Fraction, kind: str, err: Fraction) -> str:
    if value != 0 and fmt.round_exact(value).overflow:
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
        return "inf" if kind == "inf" else _overflow_text(fmt)
    if isinstance(value, float):
        return "-0"
    return _overflow_text(fmt)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- decoding, step by step ----------------------------------------------------------------
def explain_bits(text: str, fmt: FloatFormat | str | None = None) -> str:
    """Decode a pattern field by field; the format comes from the grouping or `fmt`."""
    given = fmt is not None
    fmt, bits = parse_bits(text, fmt)
    s, e, m = fmt.fields(bits)
    how = "given by --format" if given else "inferred from the pattern"
    out = [
        f"{fmt.format_bits(bits)} ({fmt.hex_bits(bits)}) read as {fmt.name} ({how})",
        f"   {_layout(fmt)}",
        "",
        f"sign      S = {s} → {'negative' if s else 'positive'}",
    ]
    ebits, mbits, kind = (
        f"{e:0{fmt.exponent_bits}b}",
        f"{m:0{fmt.mantissa_bits}b}",
        fmt.classify(bits),
    )
    if kind == "nan":
        if fmt.encoding == "fn":
            why = f"S.{ebits}.{mbits} is {fmt.name}'s only NaN code (this format has no inf)"
        else:
            why = "exponent all ones, mantissa ≠ 0"
        return "\n".join(
            [*out, f"exponent  {ebits}{TWO} = {e}", f"mantissa  {mbits}", f"value     NaN: {why}"]
        )
    if kind == "inf":
        return "\n".join(
            [*out, f"exponent  {ebits}{TWO} = {e}: all ones", f"mantissa  {mbits} = 0",
             f"value     {'-' if s else '+'}infinity"]
        )  # fmt: skip
    if kind == "zero":
        return "\n".join(
            [*out, f"exponent  {ebits}, mantissa {mbits}: all zero → {'-' if s else '+'}0"]
        )
    if kind == "subnormal":
        out.append(
            f"exponent  {ebits}{TWO} = 0 → subnormal: no implicit 1, value = 0.M × 2^(1−{fmt.bias})"
            f" = 0.M × 2^{fmt.emin}"
        )
        lead, E = 0, fmt.emin
    else:
        E = e - fmt.bias
        top = (
            " (fn: the all-ones exponent is an ordinary one here)" if e == fmt.exponent_mask else ""
        )
        out.append(f"exponent  {ebits}{TWO} = {e} → E = {e} − {fmt.bias} = {E}{top}")
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
    value = fmt.decode_exact(bits)
    assert isinstance(value, Fraction)
    out.append(
        f"value     {'-' if s else '+'}{show(sig, limit=60)} × 2^{E} = {_decoded(fmt, bits)}"
    )
    return "\n".join(out)
