"""One scaled FP8 matmul, two ways: `torch._scaled_mm` or emulation.

    fp8_mm(a8, sa, b8, sb) = (a8 / sa) @ (b8 / sb)

a8 (M, K) and b8 (K, N) hold FP8 values; each scale is None (1), a 0-d tensor, or one
per row of a (M, 1) / per column of b (1, N) — scales along the reduction dimension K
cannot be applied after the product, so callers fold those in before quantising.

- emulate: dequantise both operands to fp32 (exact: every FP8 value is an fp32 value,
  and power-of-two scales divide exactly; by table look-up, see `dequantize_fp8`) and
  multiply in fp32. This is the reference
  path: it equals a codec-built reference bit for bit (tests/test_fp8.py).
- scaled_mm: `torch._scaled_mm` multiplies the FP8 operands directly and applies the
  inverse scales to the fp32 accumulator — the fast path on GPUs with FP8 tensor cores
  (sm_89+). torch 2.13 also runs it on CPU, tensorwise and rowwise, any shape, E4M3 and
  E5M2 mixed, equal to emulation bit for bit in our tests, but not faster. CUDA wants
  dims that are multiples of 16, `a` row-major and `b` column-major; we arrange the
  layout and fall back to emulation for shapes it cannot take.

Whether `_scaled_mm` works is probed once per (device, dtypes, scale kind) with a tiny
product, because support differs by torch build, device and GPU generation.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from zerotrain.numerics.codec import decode_tensor
from zerotrain.numerics.formats import FP8_E4M3, FP8_E5M2

__all__ = ["dequantize_fp8", "fp8_mm", "resolve_matmul", "scaled_mm_out_dtype"]

_OUT_DTYPES = (torch.float32, torch.bfloat16)  # preferred first


@functools.cache
def scaled_mm_out_dtype(device: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
                        rowwise: bool) -> torch.dtype | None:
    """The output dtype `_scaled_mm` accepts for this combination, or None if it fails."""
    fn = getattr(torch, "_scaled_mm", None)
    if fn is None:
        return None
    dev = torch.device(device)
    a = torch.ones(16, 32, device=dev).to(a_dtype)
    b = torch.ones(16, 32, device=dev).to(b_dtype).t()  # column-major (32, 16)
    if rowwise:
        sa = torch.ones(16, 1, device=dev)
        sb = torch.ones(1, 16, device=dev)
    else:
        sa = sb = torch.ones((), device=dev)
    for out_dtype in _OUT_DTYPES:
        try:
            out = fn(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue
        if out.shape == (16, 16) and bool((out.float() == 32).all()):
            return out_dtype
    return None


def resolve_matmul(choice: str, a8: Tensor, b8: Tensor, rowwise: bool) -> str:
    """'scaled_mm' or 'emulate' for this product (`choice`: auto | scaled_mm | emulate).

    auto takes `_scaled_mm` on CUDA only: on CPU torch 2.13 runs it correctly but no
    faster than emulation, often slower (bench/fp8.py measures both). `scaled_mm` asked
    for but unsupported still emulates: the two paths compute the same numbers, and a run
    should not die over a missing kernel.
    """
    dev = a8.device
    if choice == "emulate" or (choice == "auto" and dev.type != "cuda"):
        return "emulate"
    if scaled_mm_out_dtype(_dev_key(dev), a8.dtype, b8.dtype, rowwise) is None:
        return "emulate"
    if dev.type == "cuda" and any(d % 16 for d in (*a8.shape, b8.shape[1])):
        return "emulate"
    return "scaled_mm"


def _dev_key(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return dev.type


@functools.cache
def _decode_table(dtype: torch.dtype, device: str) -> Tensor:
    """All 256 values of an FP8 dtype, decoded by the bit-level codec."""
    fmt = FP8_E4M3 if dtype == torch.float8_e4m3fn else FP8_E5M2
    return decode_tensor(fmt, torch.arange(256)).to(torch.float32).to(device)


def dequantize_fp8(q: Tensor, scale: Tensor | None = None) -> Tensor:
    """q / scale in fp32, by table look-up.

    torch 2.13 converts float8 → fp32 one element at a time on CPU (~6 ns each); indexing
    a 256-entry table is about 6× faster, and a 0-d scale folds into the table for free.
    The table is the codec's decoding, equal to torch's cast (tests/test_fp8.py).
    """
    if q.ndim == 2 and not q.is_contiguous() and q.t().is_contiguous():
        # a transposed view: decode its storage, return the same view (BLAS sees the layout
        # it would have seen)
        return dequantize_fp8(q.t(), scale.t() if scale is not None else None).t()
    table = _decode_table(q.dtype, _dev_key(q.device))
    if scale is not None and scale.ndim == 0:
        table, scale = table / scale, None
    idx = q.reshape(-1).view(torch.uint8).to(torch.int32)
    out = torch.index_select(table, 0, idx).view(q.shape)
    if scale is not None:
        out = out / scale
    return out


def _emulate(a8: Tensor, sa: Tensor | None, b8: Tensor, sb: Tensor | None) -> Tensor:
    return dequantize_fp8(a8, sa) @ dequantize_fp8(b8, sb)


def _scaled(a8: Tensor, sa: Tensor | None, b8: Tensor, sb: Tensor | None,
            rowwise: bool) -> Tensor:
    M, N = a8.shape[0], b8.shape[1]
    one = torch.ones((), device=a8.device)
    inv_a = one / sa if sa is not None else one
    inv_b = one / sb if sb is not None else one
    if rowwise:  # both scales must then be per row / per column
        inv_a = inv_a.expand(M, 1).contiguous()
        inv_b = inv_b.expand(1, N).contiguous()
    if a8.device.type == "cuda":  # cuBLASLt's FP8 layout: a row-major, b column-major
        a8 = a8.contiguous()
        b8 = b8.t().contiguous().t()
    out_dtype = scaled_mm_out_dtype(_dev_key(a8.device), a8.dtype, b8.dtype, rowwise)
    out = torch._scaled_mm(a8, b8, scale_a=inv_a.float(), scale_b=inv_b.float(),
                           out_dtype=out_dtype)
    return out.to(torch.float32)


def fp8_mm(a8: Tensor, sa: Tensor | None, b8: Tensor, sb: Tensor | None,
           matmul: str = "auto") -> Tensor:
    """(a8 / sa) @ (b8 / sb) in fp32 (module docstring for the scale shapes)."""
    rowwise = any(s is not None and s.ndim == 2 for s in (sa, sb))
    if resolve_matmul(matmul, a8, b8, rowwise) == "scaled_mm":
        return _scaled(a8, sa, b8, sb, rowwise)
    return _emulate(a8, sa, b8, sb)
