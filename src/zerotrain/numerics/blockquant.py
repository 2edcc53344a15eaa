"""Block-wise 8-bit storage of optimizer states, bf16 stochastic rounding and its noise.

An int8 state keeps one byte per element (an index into a 255-entry code book) and one
fp32 scale per block of `BLOCK` elements: the block's largest magnitude. An element is
stored as the code nearest to x / scale, read back as code · scale.

The code books are *dynamic* (non-linear), after the 8-bit optimizer literature (Dettmers
et al., block-wise dynamic quantisation): values near the block's maximum get fine
steps, small ones coarse steps over many decades, so a small moment next to a large one
in the same block is kept approximately rather than flushed to zero. Each decade below
the maximum gets half the levels of the one above it:

- `SIGNED` (momentum, first moments): 0 and ±127 magnitudes, decades 10^0..10^-6 with
  64, 32, 16, 8, 4, 2, 1 levels, linear within a decade.
- `UNSIGNED` (second moments): 0 and 255 magnitudes, decades 10^0..10^-7 with
  128 .. 1 levels. The second moment v is stored as √v: that halves its range in
  decades (8 decades of √v are 16 of v), and the update divides by √v anyway.

Blocks start at the tensor's first element; the ZeRO layouts align every parameter and
shard to `BLOCK` when int8 states are on (`zero.cut.align_for`), so a block never
straddles a shard boundary and any world size or stage quantises the same blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: elements per quantisation block (one fp32 scale each)
BLOCK = 256


def _magnitudes(levels_top: int, decades: int) -> list[float]:
    """Positive code magnitudes in (0, 1]: decade d (values in (10^-(d+1), 10^-d]) gets
    levels_top / 2^d levels, evenly spaced, ending at its top."""
    out: list[float] = []
    for d in range(decades):
        n = levels_top >> d
        lo, hi = 10.0 ** -(d + 1), 10.0**-d
        out += [lo + (hi - lo) * (k + 1) / n for k in range(n)]
    return sorted(out)


def _book(signed: bool) -> Tensor:
    mags = _magnitudes(64, 7) if signed else _magnitudes(128, 8)
    vals = ([-m for m in reversed(mags)] if signed else []) + [0.0] + mags
    return torch.tensor(vals, dtype=torch.float64)


#: the code books (float64, ascending); an int8 state stores indices into one of them
SIGNED = _book(True)
UNSIGNED = _book(False)
_CACHE: dict[tuple[bool, torch.device], tuple[Tensor, Tensor]] = {}


def book(signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """(codes, midpoints between neighbours) as fp32 on `device` (cached)."""
    key = (signed, device)
    if key not in _CACHE:
        codes = (SIGNED if signed else UNSIGNED).to(torch.float32)
        mids = (codes[1:] + codes[:-1]) / 2
        _CACHE[key] = codes.to(device), mids.to(device)
    return _CACHE[key]


def n_blocks(numel: int) -> int:
    """Scales an int8 state of `numel` elements keeps."""
    return -(-numel // BLOCK)


def _padded(x: Tensor) -> Tensor:
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    flat = x.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def quantize_(x: Tensor, codes_out: Tensor, scales_out: Tensor, signed: bool) -> None:
    """Store fp32 `x` (flat, its first element starting a block) as uint8 `codes_out`
    (same numel) and fp32 `scales_out` (one per block)."""
    blocks = _padded(x.float())
    scale = blocks.abs().amax(dim=1)
    scales_out.copy_(scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    _, mids = book(signed, x.device)
    idx = torch.bucketize(blocks / safe[:, None], mids)
    codes_out.view(-1).copy_(idx.view(-1)[: x.numel()])


def dequantize(codes_in: Tensor, scales_in: Tensor, signed: bool) -> Tensor:
    """fp32 values of a quantised state: code · scale per element (flat)."""
    codes, _ = book(signed, codes_in.device)
    n = codes_in.numel()
    pad = n_blocks(n) * BLOCK - n
    idx = codes_in.reshape(-1).long()
    if pad:
        idx = torch.cat([idx, idx.new_zeros(pad)])
    vals = codes[idx].view(-1, BLOCK) * scales_in[:, None]
    return vals.view(-1)[:n]


# ----------------------------------------------------------------------------- rounding


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix of int64 `x` (murmur3's finaliser), kept in int64."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & m
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & m
    return x ^ (x >> 16)


def noise16(start: int, numel: int, seed: int, device: torch.device) -> Tensor:
    """16 random bits per element, a pure function of (element index, seed): the
    element at global index `start + i` gets the same bits on any rank and in any
    chunking, so stochastic rounding keeps replicas and world sizes equal."""
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return (
        _hash32(idx * 0x9E3779B1 + _hash32(torch.tensor(seed, dtype=torch.int64)).item()) & 0xFFFF
    )


def stochastic_bf16(x: Tensor, noise: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16 up or down with probability by distance: the 16 bits
    bf16 drops are compared with `noise` (integers in [0, 2^16)). Unbiased: E[result] = x."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    bits = (bits + noise) & ~0xFFFF
    out = bits.to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float()).to(torch.bfloat16)
