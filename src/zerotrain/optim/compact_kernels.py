"""The element-wise work of a compact update, eager or through torch.compile, and the
scratch it runs in.

A compact step is: dequantise (or widen) each state chunk into fp32, run the fp32 rule,
requantise (or round) it back, and store the weights (Kahan or stochastic rounding for
bf16 masters). Eager torch runs each of these as several passes over the chunk; compiled,
each is one fused loop. The two give the same bits: the quantiser's code is defined by
comparisons with the code book's fp32 midpoints (`blockquant.nearest` finds it by
arithmetic when compiled, `torch.bucketize` eagerly: the same index), and every other
operation is a single IEEE operation inductor emits unchanged (no fast-math, no
contraction by default). So ranks that compile and ranks that could not still agree.

Scratch: the fp32 chunks live in buffers kept per thread, device and use, grown when a
bigger chunk comes and reused across chunks and steps (no allocation per chunk; a chunk
of 2^18 elements stays in L2 between the passes of the rule).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from zerotrain.numerics import blockquant as Q

_LOCAL = threading.local()
_COMPILED: dict[str, Callable] = {}
_BROKEN = False
#: compiled quantiser: codes by `blockquant.nearest`'s arithmetic (else by the lookup)
ARITHMETIC = True


def scratch(
    slot: str, numel: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A reusable flat buffer of at least `numel` elements (its first `numel` returned)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    key = (slot, device, dtype)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


# ----------------------------------------------------------------------------- the work


def _quant(x: Tensor, codes: Tensor, scales: Tensor, signed: bool) -> None:
    """Compiled: the definition, fused by inductor into a loop or two."""
    Q.quantize_blocks_(x, codes, scales, signed, arithmetic=ARITHMETIC)


def _quant_eager(x: Tensor, codes: Tensor, scales: Tensor, signed: bool) -> None:
    """Eager: the same codes in as few passes as torch allows, in place in the scratch
    `x` (one reduction, one division, then `blockquant.nearest_lookup` into `codes`)."""
    torch.amax(x.abs(), 1, out=scales)  # (vector_norm(inf) and aminmax: ~10× slower)
    x.div_(torch.where(scales > 0, scales, 1.0)[:, None])
    n = x.numel()
    code, threshold = Q.lookup(signed, x.device)
    k = scratch("qk", n, x.device, torch.int32)
    torch.bitwise_right_shift(x.view(-1).view(torch.int32), 23 - Q._KEY_BITS, out=k)
    k.bitwise_and_((1 << (32 - 23 + Q._KEY_BITS)) - 1)
    torch.index_select(code, 0, k, out=codes.view(-1))
    t = scratch("qt", n, x.device)
    torch.index_select(threshold, 0, k, out=t)
    up = scratch("qu", n, x.device, torch.bool)
    torch.gt(x.view(-1), t, out=up)
    codes.view(-1).add_(up)


def _dequant(codes: Tensor, scales: Tensor, book: Tensor, out: Tensor, square: bool) -> None:
    Q.dequantize_blocks_(codes, scales, book, out, square=square)


def _dequant_eager(codes: Tensor, scales: Tensor, book: Tensor, out: Tensor, square: bool) -> None:
    k = scratch("dk", codes.numel(), codes.device, torch.int32)
    k.copy_(codes.view(-1))
    torch.index_select(book, 0, k, out=out.view(-1))
    out.mul_(scales[:, None])
    if square:
        out.mul_(out)


def _kahan(x: Tensor, w_out: Tensor, comp_out: Tensor) -> None:
    """bf16 weights = x rounded; compensation = what the rounding dropped (exact in fp32:
    x and its rounding are within one bf16 ulp), rounded to bf16."""
    w = x.to(torch.bfloat16)
    w_out.copy_(w)
    comp_out.copy_(x - w.float())


def _stochastic(x: Tensor, w_out: Tensor, start: Tensor, seed_mix: Tensor) -> None:
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device) + start
    w_out.copy_(Q.stochastic_bf16(x, Q.noise_bits(idx, seed_mix)))


_TRACED: dict[str, Callable] = {
    "quant": _quant,
    "dequant": _dequant,
    "kahan": _kahan,
    "stochastic": _stochastic,
}
_EAGER: dict[str, Callable] = {**_TRACED, "quant": _quant_eager, "dequant": _dequant_eager}


def _call(name: str, compiled: bool, *args, **kw) -> None:
    """`name`'s work, compiled when asked and the compiler works here; eager otherwise
    (a failed compile warns once and leaves every later call eager)."""
    global _BROKEN
    if compiled and not _BROKEN:
        fn = _COMPILED.get(name)
        if fn is None:
            # emulate_precision_casts: round at `.to(bfloat16)` as eager does (inductor
            # otherwise keeps the fp32 value, and Kahan's x - bf16(x) would be 0)
            fn = _COMPILED[name] = torch.compile(
                _TRACED[name], dynamic=True, options={"emulate_precision_casts": True}
            )
        try:
            fn(*args, **kw)
            return
        except Exception as e:  # no C++ compiler, a cache race, ...: stay correct
            _BROKEN = True
            warnings.warn(
                f"torch.compile of the compact optimizer states failed ({e!r:.200}); "
                "they run eager (same numbers, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    _EAGER[name](*args, **kw)


class Kernels:
    """The compact update's element-wise steps, compiled or eager (same bits)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled

    def quant(self, x: Tensor, codes: Tensor, scales: Tensor, signed: bool, sqrt: bool) -> None:
        """fp32 blocks `x` [n, BLOCK] → uint8 `codes` [n, BLOCK] and `scales` [n]; `sqrt`:
        of √max(x, 0), taken eagerly in place (inductor's sqrt rounds differently from
        eager torch's in the last bit, and eager's defines the stored numbers)."""
        if sqrt:
            x.clamp_(min=0).sqrt_()
        _call("quant", self.compiled, x, codes, scales, signed)

    def dequant(
        self, codes: Tensor, scales: Tensor, out: Tensor, signed: bool, square: bool
    ) -> None:
        """uint8 blocks → fp32 `out` (squared for √-stored second moments)."""
        book = Q.tables(signed, codes.device)[0]
        _call("dequant", self.compiled, codes, scales, book, out, square)

    def kahan(self, x: Tensor, w_out: Tensor, comp_out: Tensor) -> None:
        """Store fp32 `x` as bf16 weights plus bf16 compensation."""
        _call("kahan", self.compiled, x, w_out, comp_out)

    def stochastic(self, x: Tensor, w_out: Tensor, start: int, seed: int) -> None:
        """Store fp32 `x` as bf16, stochastically rounded with the bits of elements
        `start`, `start + 1`, … at `seed` (`blockquant.noise16`)."""
        if not self.compiled or _BROKEN:  # eager: the int32 form, the same bits
            Q.stochastic_bf16_(x, w_out, start, seed)
            return
        dev = x.device
        start_t = torch.tensor(start, dtype=torch.int64, device=dev)
        _call("stochastic", self.compiled, x, w_out, start_t, Q.seed_mix(seed, dev))


def compile_broken() -> bool:
    """Whether compiling the compact kernels failed in this process (then all run eager)."""
    return _BROKEN
