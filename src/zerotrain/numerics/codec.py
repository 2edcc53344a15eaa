"""Vectorised encode/decode between torch float tensors and a format's bit patterns.

The scalar rules live in `FloatFormat` (exact, pure Python); these are the same rules with
integer tensor ops on float64 bit patterns, so that every one of the 65,536 fp16/bf16
patterns (or a million random values) can be checked against torch's own casts at once.
Kept apart so that `zerotrain float` never imports torch.
"""

from __future__ import annotations

import math

import torch

from zerotrain.numerics.formats import FloatFormat

__all__ = ["decode_tensor", "encode_tensor"]


def decode_tensor(fmt: FloatFormat, bits: torch.Tensor) -> torch.Tensor:
    """Vectorised decode of integer patterns (any int dtype; sign-extended views are fine)."""
    b = bits.to(torch.int64) & ((1 << fmt.total_bits) - 1)
    sign = (b >> (fmt.total_bits - 1)) & 1
    e = (b >> fmt.mantissa_bits) & fmt.exponent_mask
    m = b & fmt.mantissa_mask
    normal = e != 0
    bias = 1 - fmt.emin  # = fmt.bias, set for every format
    sig = torch.where(normal, m | (1 << fmt.mantissa_bits), m).to(torch.float64)
    exp = torch.where(normal, e - bias, torch.full_like(e, fmt.emin))
    val = torch.ldexp(sig, (exp - fmt.mantissa_bits).to(torch.float64))
    top = e == fmt.exponent_mask
    if fmt.encoding == "fn":
        val = torch.where(top & (m == fmt.mantissa_mask), math.nan, val)
    else:
        val = torch.where(top, torch.where(m == 0, math.inf, math.nan), val)
    return torch.where(sign == 1, -val, val)


def encode_tensor(fmt: FloatFormat, t: torch.Tensor) -> torch.Tensor:
    """Vectorised `encode` of a float tensor → int64 patterns (unsigned, < 2^total_bits).

    Works on the float64 bit pattern (exact for float32/16/bf16 inputs) with integer
    shifts only: |x| = M·2^E, keep M >> shift, round with the remainder vs half.
    """
    if fmt.mantissa_bits > 51 or fmt.emin - fmt.mantissa_bits < -1000:
        raise ValueError(f"{fmt.name}: too wide for the float64-based vectorised path")
    x = t.detach().to(torch.float64).contiguous()
    b = x.view(torch.int64)
    sign = (b >> 63) & 1
    e64 = (b >> 52) & 0x7FF
    m64 = b & ((1 << 52) - 1)
    normal = e64 != 0
    M = torch.where(normal, m64 | (1 << 52), m64)
    # float64 subnormals (< 2^-1022) sit far below every format's smallest subnormal;
    # pretending their exponent is -1022 still yields the right (zero) result.
    ue = torch.where(normal, e64 - 1023, torch.full_like(e64, -1022))
    eff = torch.clamp(ue, min=fmt.emin)
    shift = (eff - fmt.mantissa_bits - ue + 52).clamp(max=62)  # ≥ 1 since m ≤ 51
    one = torch.ones_like(shift)
    r = M >> shift
    rest = M & ((one << shift) - 1)
    half = one << (shift - 1)
    up = (rest > half) | ((rest == half) & ((r & 1) == 1))
    mag = ((eff - fmt.emin) << fmt.mantissa_bits) + r + up.to(torch.int64)
    over = mag > fmt.max_finite_bits
    mag = torch.where(over, fmt.overflow_bits(False), mag)
    special = e64 == 0x7FF
    is_nan = special & (m64 != 0)
    inf_mag = fmt.inf_bits() if fmt.has_inf else fmt.overflow_bits(False)
    mag = torch.where(special & ~is_nan, inf_mag, mag)
    mag = torch.where(is_nan, fmt.nan_bits(), mag)
    return mag | (sign << (fmt.total_bits - 1))
