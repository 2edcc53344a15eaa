"""Block-quantised integer codes for the wire (ZeRO++'s qwZ and qgZ).

A 1-D tensor is cut into blocks of `block` elements (the last may be shorter); each
block gets one fp32 scale, its absolute maximum over the largest code (127 for int8, 7
for int4), and each element the nearest integer code of value / scale (ties to even,
as `torch.round`). Symmetric codes keep zero exact and need no zero point; an all-zero
block has scale 0 and decodes to zeros. int4 codes are packed two to a byte (low nibble
first), offset by 8 so a byte holds two values in 0..15.

The error bound, per element: |x - decode(encode(x))| <= scale / 2 = absmax(block) /
(2 * qmax) — what the qgZ/qwZ tests assert and the docs state.

`encode` returns one uint8 buffer (codes, then the scales' bytes), so a single uint8
collective moves both; `encoded_bytes` is its size, the wire's memory and traffic term.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

QMAX = {8: 127, 4: 7}
BLOCK = 256


def code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def encoded_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of `encode`'s buffer for `numel` elements: the codes, then fp32 scales."""
    return code_bytes(numel, bits) + 4 * math.ceil(numel / block)


def block_scales(x: Tensor, bits: int, block: int = BLOCK) -> Tensor:
    """fp32 scale per block: the block's absolute maximum over the largest code."""
    n = x.numel()
    nblocks = math.ceil(n / block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1).float().abs()
    return padded.view(nblocks, block).amax(dim=1) / QMAX[bits]


def encode(x: Tensor, bits: int, block: int = BLOCK, out: Tensor | None = None) -> Tensor:
    """`x` (any float dtype, 1-D view) as codes + scales in one uint8 buffer."""
    if bits not in QMAX:
        raise ValueError(f"wire codes are 8 or 4 bits, got {bits}")
    n = x.numel()
    scales = block_scales(x, bits, block)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    per_elem = safe.repeat_interleave(block)[:n]
    q = torch.round(x.reshape(-1).float() / per_elem).clamp_(-QMAX[bits], QMAX[bits])
    size = encoded_bytes(n, bits, block)
    buf = torch.empty(size, dtype=torch.uint8, device=x.device) if out is None else out
    cb = code_bytes(n, bits)
    if bits == 8:
        buf[:cb].copy_(q.to(torch.int8).view(torch.uint8))
    else:
        u = (q.to(torch.int16) + 8).to(torch.uint8)
        if n % 2:
            u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
        pairs = u.view(-1, 2)
        buf[:cb].copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    buf[cb:size].copy_(scales.view(torch.uint8))
    return buf


def decode(buf: Tensor, numel: int, bits: int, dtype: torch.dtype, block: int = BLOCK,
           out: Tensor | None = None) -> Tensor:
    """The values `encode` wrote into `buf` (its first `encoded_bytes` bytes)."""
    cb = code_bytes(numel, bits)
    nblocks = math.ceil(numel / block)
    scales = buf[cb:cb + 4 * nblocks].clone().view(torch.float32)
    if bits == 8:
        q = buf[:cb].view(torch.int8).float()
    else:
        raw = buf[:cb]
        q = torch.stack([(raw & 0xF), (raw >> 4)], dim=1).reshape(-1)[:numel]
        q = q.float() - 8
    vals = q * scales.repeat_interleave(block)[:numel]
    if out is None:
        return vals.to(dtype)
    out.copy_(vals)
    return out
