"""Binary floating-point layouts (SPEC §3), derived from (exponent bits, mantissa bits) alone.

A `FloatFormat` knows nothing but its layout and its special-value rules; every property
(max finite, min normal, epsilon, ...) is computed from them with exact arithmetic, so the
table printed by `zerotrain formats` and the tests against `torch.finfo` check the theory,
not a list of copied constants. Encoding rounds to nearest, ties to even, exactly like
torch's casts: the tensor versions (`codec.py`) use only integer ops on float64 bit
patterns; the exact scalar ones that `zerotrain float` prints step by step (fields,
decode, round, encode) are `zerotrain.cli.float_bits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported lazily: `zerotrain float` should start fast
    import torch

__all__ = [
    "ALL_FORMATS",
    "BF16",
    "FORMATS",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP16",
    "FP32",
    "TF32",
    "FloatFormat",
    "floor_log2",
    "get_format",
]

@dataclass(frozen=True)
class FloatFormat:
    """A sign/exponent/mantissa layout plus its rules for inf, NaN and overflow.

    encoding "ieee": exponent all ones = inf (mantissa 0) or NaN. encoding "fn" (OCP FP8
    E4M3): finite-only, exponent all ones is an ordinary exponent and only S.1…1.1…1 is NaN.
    overflow is what a cast does with a value too large for the format: "inf", "saturate"
    (clamp to ±max finite; inputs ±inf too when the format has no inf, as torch's E4M3 cast
    does) or "nan". nan_mantissa picks the canonical NaN that encode produces; like torch's
    casts it keeps the input's sign (torch's bf16 NaN varies with the code path: 0x7FC0 or
    0xFFFF, so only "is a NaN" is comparable there).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    encoding: Literal["ieee", "fn"] = "ieee"
    overflow: Literal["inf", "saturate", "nan"] = "inf"
    nan_mantissa: int | None = None  # canonical NaN mantissa; None = quiet bit only (IEEE)
    torch_dtype_name: str | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if self.exponent_bits < 2 or self.mantissa_bits < 1:
            raise ValueError(f"{self.name}: need ≥2 exponent bits and ≥1 mantissa bit")
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.exponent_bits - 1) - 1)
        if self.encoding == "fn" and self.overflow == "inf":
            raise ValueError(f"{self.name}: a format without inf cannot overflow to inf")
        if self.nan_mantissa is None:
            quiet = self.mantissa_mask if self.encoding == "fn" else 1 << (self.mantissa_bits - 1)
            object.__setattr__(self, "nan_mantissa", quiet)

    # ---- layout --------------------------------------------------------------------------
    @property
    def _bias(self) -> int:
        assert self.bias is not None  # set by __post_init__
        return self.bias

    @property
    def _nan_mantissa(self) -> int:
        assert self.nan_mantissa is not None
        return self.nan_mantissa

    @property
    def total_bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def exponent_mask(self) -> int:
        return (1 << self.exponent_bits) - 1

    @property
    def mantissa_mask(self) -> int:
        return (1 << self.mantissa_bits) - 1

    @property
    def has_inf(self) -> bool:
        return self.encoding == "ieee"

    @property
    def emin(self) -> int:
        """Smallest normal exponent; subnormals share it (0.M × 2^emin)."""
        return 1 - self._bias

    @property
    def emax(self) -> int:
        """Largest exponent of a finite number (fn formats use the all-ones exponent too)."""
        top = self.exponent_mask if self.encoding == "fn" else self.exponent_mask - 1
        return top - self._bias

    # ---- derived values (exact) ----------------------------------------------------------
    @property
    def max_finite_bits(self) -> int:
        """Magnitude bits of the largest finite number (fn: mantissa 1…10, as 1…11 is NaN)."""
        if self.encoding == "fn":
            return (self.exponent_mask << self.mantissa_bits) | (self.mantissa_mask - 1)
        return ((self.exponent_mask - 1) << self.mantissa_bits) | self.mantissa_mask

    @property
    def max_finite_exact(self) -> Fraction:
        return self.magnitude_exact(self.max_finite_bits)

    @property
    def min_normal_exact(self) -> Fraction:
        return Fraction(2) ** self.emin

    @property
    def min_subnormal_exact(self) -> Fraction:
        return Fraction(2) ** (self.emin - self.mantissa_bits)

    @property
    def epsilon_exact(self) -> Fraction:
        """Gap between 1 and the next number: 2^-m (torch.finfo.eps)."""
        return Fraction(1, 1 << self.mantissa_bits)

    @property
    def max_finite(self) -> float:
        return float(self.max_finite_exact)

    @property
    def min_normal(self) -> float:
        return float(self.min_normal_exact)

    @property
    def min_subnormal(self) -> float:
        return float(self.min_subnormal_exact)

    @property
    def epsilon(self) -> float:
        return float(self.epsilon_exact)

    @property
    def decimal_digits(self) -> float:
        """Information in the significand, (m+1)·log10 2 (fp32 ≈ 7.22, fp16 ≈ 3.31).

        We count the implicit leading bit because it carries precision too; numpy's
        finfo.precision = floor(m·log10 2) is the stricter "digits that always survive a
        decimal → binary → decimal round trip" (fp32: 6).
        """
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching torch dtype, or None (TF32 only exists inside tensor cores)."""
        if self.torch_dtype_name is None:
            return None
        import torch

        return getattr(torch, self.torch_dtype_name, None)

    # ---- special patterns ----------------------------------------------------------------
    @property
    def sign_bit(self) -> int:
        return 1 << (self.total_bits - 1)

    def nan_bits(self, negative: bool = False) -> int:
        """Canonical NaN: the pattern torch's casts produce (sign kept)."""
        mag = (self.exponent_mask << self.mantissa_bits) | self._nan_mantissa
        return mag | (self.sign_bit if negative else 0)

    def inf_bits(self, negative: bool = False) -> int | None:
        if not self.has_inf:
            return None
        return (self.exponent_mask << self.mantissa_bits) | (self.sign_bit if negative else 0)

    # ---- values --------------------------------------------------------------------------
    def magnitude_exact(self, mag_bits: int) -> Fraction:
        """The exact value of a pattern's magnitude bits (sign bit clear, not inf or NaN)."""
        e, m = mag_bits >> self.mantissa_bits, mag_bits & self.mantissa_mask
        if e == 0:
            return Fraction(m) * Fraction(2) ** (self.emin - self.mantissa_bits)
        unbiased = e - self._bias
        return Fraction((1 << self.mantissa_bits) | m) * Fraction(2) ** (
            unbiased - self.mantissa_bits
        )

    def overflow_bits(self, negative: bool) -> int:
        """The pattern a cast gives a magnitude beyond max finite (inf, ±max or NaN)."""
        s = self.sign_bit if negative else 0
        inf = self.inf_bits(negative)
        if self.overflow == "inf" and inf is not None:
            return inf
        if self.overflow == "saturate":
            return self.max_finite_bits | s
        return self.nan_bits(negative)

    def __str__(self) -> str:
        return self.name


FP32 = FloatFormat(
    "fp32", 8, 23, torch_dtype_name="float32",
    aliases=("float32", "f32", "float", "single", "binary32"),
    description="IEEE 754 binary32",
)  # fmt: skip
TF32 = FloatFormat(
    "tf32", 8, 10, aliases=("tensorfloat32", "tensorfloat-32"),
    description="tensor-core matmul input; no torch dtype (reference only)",
)  # fmt: skip
FP16 = FloatFormat(
    "fp16", 5, 10, torch_dtype_name="float16",
    aliases=("float16", "f16", "half", "binary16"),
    description="IEEE 754 binary16; small range, needs loss scaling",
)  # fmt: skip
BF16 = FloatFormat(
    "bf16", 8, 7, torch_dtype_name="bfloat16", aliases=("bfloat16", "brain-float"),
    description="fp32's top 16 bits",
)  # fmt: skip
FP8_E4M3 = FloatFormat(
    "fp8-e4m3", 4, 3, encoding="fn", overflow="saturate", torch_dtype_name="float8_e4m3fn",
    aliases=("e4m3", "e4m3fn", "fp8-e4m3fn", "float8-e4m3fn", "fp8e4m3"),
    description="OCP FP8 for weights/activations",
)  # fmt: skip
FP8_E5M2 = FloatFormat(
    "fp8-e5m2", 5, 2, nan_mantissa=0b11, torch_dtype_name="float8_e5m2",
    aliases=("e5m2", "float8-e5m2", "fp8e5m2"),
    description="OCP FP8 for gradients (fp16 with 8 mantissa bits cut)",
)  # fmt: skip

#: Formats in the order tables list them.
ALL_FORMATS: tuple[FloatFormat, ...] = (FP32, TF32, FP16, BF16, FP8_E4M3, FP8_E5M2)


def floor_log2(n: int, d: int = 1) -> int:
    """floor(log2(n/d)) for positive ints, exactly (integer shifts, no float)."""
    e = n.bit_length() - d.bit_length()
    return e - 1 if (n << max(0, -e)) < (d << max(0, e)) else e


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


FORMATS: dict[str, FloatFormat] = {}
for _f in ALL_FORMATS:
    for _n in (_f.name, *_f.aliases):
        FORMATS[_key(_n)] = _f


def get_format(name: str | FloatFormat) -> FloatFormat:
    """Look a format up by name or alias (case and -/_ insensitive)."""
    if isinstance(name, FloatFormat):
        return name
    try:
        return FORMATS[_key(name)]
    except KeyError:
        valid = ", ".join(f.name for f in ALL_FORMATS)
        aliases = ", ".join(a for f in ALL_FORMATS for a in f.aliases)
        raise ValueError(
            f"unknown float format {name!r}; valid: {valid} (aliases: {aliases})"
        ) from None
