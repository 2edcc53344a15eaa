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
_CACHE: dict[tuple[bool, torch.device], tuple[Tensor, Tensor, Tensor]] = {}
#: decades of each book (the top one has 2^(decades - 1) levels)
_DECADES = {True: 7, False: 8}


def book(signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """(codes, midpoints between neighbours) as fp32 on `device` (cached)."""
    codes, mids, _ = tables(signed, device)
    return codes, mids


def tables(signed: bool, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, midpoints, midpoints with -inf and +inf at the ends) as fp32 (cached):
    code i is nearest to y when ends[i] < y <= ends[i + 1], as `torch.bucketize`."""
    key = (signed, device)
    if key not in _CACHE:
        codes = (SIGNED if signed else UNSIGNED).to(torch.float32)
        mids = (codes[1:] + codes[:-1]) / 2
        inf = torch.tensor([float("inf")])
        ends = torch.cat([-inf, mids, inf])
        _CACHE[key] = codes.to(device), mids.to(device), ends.to(device)
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


def nearest(y: Tensor, ends: Tensor, signed: bool) -> Tensor:
    """Index of the code nearest to each y in [-1, 1] (int64): exactly
    `torch.bucketize(y, midpoints)`, found by arithmetic instead of a binary search.

    The candidate comes from the book's shape: decade d = floor(-log10 |y|) holds n_d =
    top / 2^d evenly spaced levels ending at 10^-d, the first n_d - 1 magnitude indices
    belong to the decades below, so |y|'s nearest level is n_d - 2 + round((|y| -
    10^-(d+1)) / step_d). Rounding of log10 and of that quotient can put it one code off
    near a decade's edge or a midpoint; one comparison with each neighbouring midpoint
    (`ends`) makes it exact. Element-wise arithmetic only: torch.compile fuses it."""
    decades = _DECADES[signed]
    a = y.abs()
    d = torch.floor(-torch.log10(a)).clamp(0, decades - 1)  # y = 0: the lowest decade
    n = torch.exp2((decades - 1) - d)
    lo = torch.pow(10.0, -(d + 1))
    last = d == decades - 1  # one level, 10^-(decades-1), and below it only 0
    lo = torch.where(last, 0.0, lo)
    step = torch.where(last, 10.0 ** -(decades - 1), 9 * lo / n)
    t = torch.minimum(torch.round((a - lo) / step).clamp(min=0), n)
    mag = n - 1 + t  # 1 + the magnitude index; 0: the code 0
    idx = 127 + torch.sign(y) * mag if signed else mag
    i = idx.to(torch.int64).clamp(0, ends.numel() - 2)
    i = i + (y > ends[i + 1]).to(torch.int64)
    return i - (y <= ends[i]).to(torch.int64)


#: a float's sign, exponent and top `_KEY_BITS` mantissa bits select its bucket in
#: `lookup`: buckets 2^-8 wide relative, narrower than any two code gaps (≥ 0.7 %)
_KEY_BITS = 8
_LOOKUP: dict[tuple[bool, torch.device], tuple[Tensor, Tensor]] = {}


def lookup(signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """(code, threshold) per bucket of float bits (uint8, fp32; 2^17 each): a y in the
    bucket has the code `code + (y > threshold)`, exactly `torch.bucketize(y,
    midpoints)` — each bucket holds at most one midpoint (its threshold; +inf if none),
    so bucketize is one of two values across it (cached)."""
    key = (signed, device)
    if key not in _LOOKUP:
        _, mids, ends = tables(signed, torch.device("cpu"))
        shift = 23 - _KEY_BITS
        lo = torch.arange(1 << (32 - shift), dtype=torch.int64) << shift
        ends_v = [
            ((b - (1 << 32) * (b >= 1 << 31)).to(torch.int32)).view(torch.float32)
            for b in (lo, lo | ((1 << shift) - 1))
        ]
        v = [torch.nan_to_num(e.clamp(-1, 1), nan=0.0) for e in ends_v]
        first = torch.bucketize(torch.minimum(*v), mids)
        finite = ends_v[0].isfinite() & ends_v[1].isfinite()  # inf/NaN: any code
        assert ((torch.bucketize(torch.maximum(*v), mids) - first)[finite] <= 1).all()
        _LOOKUP[key] = first.to(torch.uint8).to(device), ends[first + 1].to(device)
    return _LOOKUP[key]


def nearest_lookup(y: Tensor, code: Tensor, threshold: Tensor) -> Tensor:
    """`torch.bucketize(y, midpoints)` as uint8 by `lookup`'s tables: two gathers from
    small tables and a comparison, where the binary search costs ~50× more eagerly."""
    k = (y.view(torch.int32) >> (23 - _KEY_BITS)) & ((1 << (32 - 23 + _KEY_BITS)) - 1)
    k = k.long()
    return torch.take(code, k) + (y > torch.take(threshold, k))


def quantize_blocks_(
    x: Tensor,
    codes_out: Tensor,
    scales_out: Tensor,
    signed: bool,
    sqrt: bool = False,
    arithmetic: bool = False,
) -> None:
    """Whole blocks `x` (fp32, [blocks, BLOCK]) stored as uint8 `codes_out` (same shape)
    and fp32 `scales_out` ([blocks]); `sqrt`: store √max(x, 0) (second moments).
    The code is the one nearest to x / scale — `torch.bucketize` over the midpoints —
    found by `nearest_lookup`, or by `nearest`'s arithmetic (`arithmetic`): the same."""
    if sqrt:
        x = x.clamp(min=0).sqrt()
    scale = x.abs().amax(dim=1)
    scales_out.copy_(scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / safe[:, None]
    if arithmetic:
        codes_out.copy_(nearest(y, tables(signed, x.device)[2], signed))
    else:
        codes_out.copy_(nearest_lookup(y, *lookup(signed, x.device)))


def dequantize_blocks_(
    codes: Tensor, scales: Tensor, book_: Tensor, out: Tensor, square: bool = False
) -> None:
    """fp32 values of whole blocks into `out` ([blocks, BLOCK]): code · scale, squared
    for second moments (`square`: they are stored as √v)."""
    vals = book_[codes.long()] * scales[:, None]
    out.copy_(vals.square() if square else vals)


def quantize_(x: Tensor, codes_out: Tensor, scales_out: Tensor, signed: bool) -> None:
    """Store fp32 `x` (flat, its first element starting a block) as uint8 `codes_out`
    (same numel) and fp32 `scales_out` (one per block)."""
    blocks = _padded(x.float())
    codes = torch.empty(blocks.shape, dtype=torch.uint8, device=x.device)
    quantize_blocks_(blocks, codes, scales_out, signed)
    codes_out.view(-1).copy_(codes.view(-1)[: x.numel()])


def dequantize(codes_in: Tensor, scales_in: Tensor, signed: bool) -> Tensor:
    """fp32 values of a quantised state: code · scale per element (flat)."""
    n = codes_in.numel()
    pad = n_blocks(n) * BLOCK - n
    idx = codes_in.reshape(-1)
    if pad:
        idx = torch.cat([idx, idx.new_zeros(pad)])
    out = torch.empty(idx.numel(), device=codes_in.device).view(-1, BLOCK)
    dequantize_blocks_(idx.view(-1, BLOCK), scales_in, book(signed, codes_in.device)[0], out)
    return out.view(-1)[:n]


# ----------------------------------------------------------------------------- rounding


def _i32(c: int) -> int:
    """The 32-bit constant `c` as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix of int64 `x` (murmur3's finaliser), kept in int64."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & m
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & m
    return x ^ (x >> 16)


def _hash32_(x: Tensor) -> Tensor:
    """`_hash32` on int32 `x` in place, the same bits: int32 products wrap modulo 2^32
    as the int64 ones are masked, and `>>` is made logical by masking off the sign's
    copies. Half the bytes of the int64 form per pass."""
    x.bitwise_xor_((x >> 16) & 0xFFFF).mul_(_i32(0x85EBCA6B))
    x.bitwise_xor_((x >> 13) & 0x7FFFF).mul_(_i32(0xC2B2AE35))
    return x.bitwise_xor_((x >> 16) & 0xFFFF)


def seed_mix(seed: int, device: torch.device) -> Tensor:
    """The seed's contribution to every element's bits (a 0-d int64 tensor)."""
    return _hash32(torch.tensor(seed, dtype=torch.int64)).to(device)


def noise_bits(idx: Tensor, mix: Tensor) -> Tensor:
    """16 random bits for each element index in `idx` (int64) at `seed_mix` `mix`."""
    return _hash32(idx * 0x9E3779B1 + mix) & 0xFFFF


def noise16(start: int, numel: int, seed: int, device: torch.device) -> Tensor:
    """16 random bits per element, a pure function of (element index, seed): the
    element at global index `start + i` gets the same bits on any rank and in any
    chunking, so stochastic rounding keeps replicas and world sizes equal."""
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return noise_bits(idx, seed_mix(seed, device))


def stochastic_bf16_(x: Tensor, out: Tensor, start: int, seed: int) -> None:
    """`stochastic_bf16(x, noise16(start, x.numel(), seed))` into bf16 `out`, computed
    in int32 (the same bits; the eager step's form: about half the time)."""
    n = x.numel()
    k = torch.arange(n, dtype=torch.int32, device=x.device)
    base = (start * 0x9E3779B1 + int(seed_mix(seed, torch.device("cpu")))) & 0xFFFFFFFF
    k.mul_(_i32(0x9E3779B1)).add_(_i32(base))  # (start + i)·C + mix, modulo 2^32
    _hash32_(k).bitwise_and_(0xFFFF)
    k.add_(x.view(torch.int32)).bitwise_and_(_i32(0xFFFF0000))
    r = k.view(torch.float32)
    out.copy_(torch.where(torch.isfinite(x), r, x))


def stochastic_bf16(x: Tensor, noise: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16 up or down with probability by distance: the 16 bits
    bf16 drops are compared with `noise` (integers in [0, 2^16)). Unbiased: E[result] = x."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    bits = (bits + noise) & ~0xFFFF
    out = bits.to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float()).to(torch.bfloat16)
