"""FP8 all-gather for ZeRO-3: weights travel as 1 byte per element instead of 2 (bf16).

Per gather unit (one parameter, or any run of elements that should share a scale):

    1. a = local_amax(my shard piece)                      every rank, no communication
    2. all-reduce(MAX) of all units' amaxes at once        one small message per step
       (`unit_amaxes` stacks them into one tensor)
    3. bytes, scale = quantize_shard(piece, a_global)      E4M3, 1 byte per element
    4. all-gather the uint8 bytes                          half of bf16's traffic
    5. full = dequantize(gathered, scale, dtype)

Because every rank derives the scale from the same all-reduced amax, the scale itself
never travels and every rank dequantises identically; the gathered weight equals the
single-process quantise → dequantise of the whole tensor, bit for bit.

Scale per parameter, not per flat unit: one scale over a whole block would flush a small
weight matrix toward E4M3's subnormals whenever a larger one sets the amax. Only the FP8
linears' weights should take this path; norms and biases gathered in E4M3 would lose all
but 3 mantissa bits, so they stay in the parameter dtype.

With power-of-two scales (the default) the `Fp8Linear` that then re-quantises the
dequantised weight loses nothing more: its scale is the gather's or twice it, and a
power-of-two multiple of an E4M3 value in range is again an E4M3 value. Under the
tensorwise recipe the layer computes exactly what it computes without the FP8 gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zerotrain.numerics.formats import FP8_E4M3, FloatFormat
from zerotrain.numerics.fp8 import amax, quantize, scale_from_amax
from zerotrain.numerics.fp8_mm import dequantize_fp8

__all__ = ["dequantize", "local_amax", "quantize_shard", "unit_amaxes"]


def local_amax(shard: Tensor) -> Tensor:
    """max |x| of this rank's piece as a 0-d fp32 tensor (0 for an empty piece)."""
    return amax(shard.detach())


def unit_amaxes(pieces: Sequence[Tensor]) -> Tensor:
    """One fp32 vector of every unit's local amax, to all-reduce with MAX in one call."""
    if not pieces:
        return torch.zeros(0, dtype=torch.float32)
    return torch.stack([local_amax(p) for p in pieces])


def quantize_shard(shard: Tensor, amax_global: Tensor, fmt: FloatFormat = FP8_E4M3,
                   pow2: bool = True, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(uint8 bytes, fp32 scale) of a shard piece, scaled by the all-ranks amax.

    `out`: an optional uint8 view of the send buffer to write the bytes into. The bytes
    are the FP8 patterns (gloo and NCCL move uint8; float8 dtypes are not on every wire).
    """
    scale = scale_from_amax(amax_global.to(shard.device), fmt, pow2)
    q, _ = quantize(shard.detach(), scale, fmt, count=False)
    b = q.reshape(-1).view(torch.uint8)
    if out is not None:
        out.copy_(b)
        b = out
    return b, scale


def dequantize(gathered: Tensor, scale: Tensor, dtype: torch.dtype,
               fmt: FloatFormat = FP8_E4M3, out: Tensor | None = None,
               pow2: bool = True) -> Tensor:
    """FP8 bytes → values in `dtype` (q / scale, as if computed in fp32; exact for pow2
    scales). On the CPU by table (fp8_mm.dequantize_fp8: torch's cast is slow there); on
    an accelerator by the native cast, straight into `out` — the table's int32 indices and
    fp32 values were 8 B/element of transient memory and ~6x the traffic."""
    fp8 = fmt.torch_dtype
    if fp8 is None:
        raise ValueError(f"{fmt.name} has no torch dtype")
    if gathered.device.type != "cpu":
        return _native(gathered.view(fp8), scale.to(gathered.device), dtype, out, pow2)
    vals = dequantize_fp8(gathered.view(fp8), scale.to(gathered.device))
    if out is None:
        return vals.to(dtype)
    out.copy_(vals.view(out.shape))
    return out


def _native(q: Tensor, scale: Tensor, dtype: torch.dtype, out: Tensor | None,
            pow2: bool) -> Tensor:
    """The cast in `dtype` itself where that equals the fp32 result: fp32, or bf16 with a
    power-of-two scale (every FP8 value and its quotient are exact in bf16, whose range
    is fp32's). Else (fp16's narrow range, other scales) through one fp32 temporary."""
    if dtype == torch.float32 or (pow2 and dtype == torch.bfloat16):
        if out is None:
            out = torch.empty(q.shape, dtype=dtype, device=q.device)
        out.copy_(q.view(out.shape))
        return out.div_(scale)
    vals = q.to(torch.float32).div_(scale)
    if out is None:
        return vals.to(dtype)
    out.copy_(vals.view(out.shape))
    return out
