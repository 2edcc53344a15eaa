"""FP8 scaling: amax → scale → saturating cast, with overflow/underflow counts.

An FP8 tensor is a pair (q, s): q = sat(x·s) in E4M3 or E5M2 and x ≈ q / s. The scale s
maps the largest magnitude (amax) onto the format's max finite value, so the 8 bits
cover the tensor's own range rather than a fixed one:

    s = fmt.max / amax                  (one per tensor, or one per row)

By default s is rounded *down* to a power of two. Then x·s and q/s only move exponents,
so they are exact in fp32: the only error is the FP8 rounding itself, dequantising undoes
scaling exactly, and re-quantising already-quantised values (after an FP8 all-gather)
loses nothing. The price is at most one binade of headroom: amax lands in (max/2, max].

Guards: amax is floored at 2^-64, so an all-zero tensor gets a large finite scale and
stays zero. A non-finite amax (inf or NaN in the tensor) gives s = 0 or NaN, which turns
the whole dequantised tensor into NaN on purpose: the engine's non-finite gradient check
then skips the step, instead of training on silently saturated values.

Recipes: `tensorwise` and `rowwise` compute amax from the tensor at hand (dynamic);
`delayed` (Transformer Engine style) uses the max of an amax history of previous steps
and records the current amax for later (see `fp8_linear.Fp8Linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from zerotrain.numerics.formats import FP8_E4M3, FP8_E5M2, FloatFormat

if TYPE_CHECKING:
    from zerotrain.config import FP8Config

__all__ = [
    "AMAX_FLOOR",
    "FP8_E4M3",
    "FP8_E5M2",
    "TENSOR_CLASSES",
    "FP8Recipe",
    "FP8Stats",
    "amax",
    "quantize",
    "scale_from_amax",
]

#: smallest amax a scale is computed from (keeps the scale of an all-zero tensor finite)
AMAX_FLOOR = 2.0**-64
#: the tensor classes counted separately, in the order of `FP8Stats.counts`' rows
TENSOR_CLASSES = ("input", "weight", "grad_output")

Scaling = Literal["tensorwise", "rowwise", "delayed"]
Matmul = Literal["auto", "scaled_mm", "emulate"]


@dataclass(frozen=True)
class FP8Recipe:
    """How FP8 linears scale and multiply (the `precision.fp8` section, minus switches)."""

    scaling: Scaling = "tensorwise"
    amax_history: int = 16
    pow2_scales: bool = True
    matmul: Matmul = "auto"

    def __post_init__(self) -> None:
        if self.scaling not in ("tensorwise", "rowwise", "delayed"):
            raise ValueError(f"unknown FP8 scaling {self.scaling!r}; use tensorwise, "
                             "rowwise or delayed")
        if self.amax_history < 1:
            raise ValueError(f"amax_history must be ≥ 1, got {self.amax_history}")

    @classmethod
    def from_config(cls, cfg: FP8Config) -> FP8Recipe:
        return cls(cfg.recipe, cfg.amax_history, cfg.pow2_scales, cfg.matmul)


def amax(x: Tensor, rows: bool = False) -> Tensor:
    """max |x| in fp32: a 0-d tensor, or one per row (shape (rows, 1)) along the last dim."""
    if x.numel() == 0:
        shape = (*x.shape[:-1], 1) if rows else ()
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    # max(hi, -lo) spares abs()'s copy; on CPU aminmax is the fastest whole-tensor
    # reduction but ~20× slower than amax + amin along a dimension (torch 2.13)
    if rows:
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    else:
        lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).to(torch.float32)


def scale_from_amax(a: Tensor, fmt: FloatFormat, pow2: bool = True) -> Tensor:
    """fmt.max / amax in fp32, elementwise (module docstring: power of two, guards)."""
    a = torch.clamp(a.to(torch.float32), min=AMAX_FLOOR)  # NaN stays NaN
    s = fmt.max_finite / a  # inf → 0
    if not pow2:
        # fp32 rounds max/amax up about one time in five, and amax·s would then exceed
        # max: a spurious overflow of the largest element. One ulp less fixes it.
        return torch.where(a * s > fmt.max_finite, torch.nextafter(s, torch.zeros_like(s)), s)
    # Power of two below s: s = mant·2^exp with mant in [0.5, 1), so 2^(exp-1). The
    # rounding above cannot push s onto a power of two here: that needs an fp32 amax
    # within 2^-25 (relative) above max·2^-k, and the formats' max (1.75·2^e) has fp32
    # neighbours 2^-23.8 apart. So amax·s ≤ max holds exactly (tests check it).
    _, exp = torch.frexp(s)
    down = torch.ldexp(torch.ones_like(s), exp - 1)
    return torch.where(torch.isfinite(s) & (s > 0), down, s)


def quantize(x: Tensor, scale: Tensor, fmt: FloatFormat, saturate: bool = True,
             count: bool = True) -> tuple[Tensor, Tensor | None]:
    """(q, counts): q = sat(x·scale) in fmt's torch dtype; counts = [overflow, underflow].

    overflow: elements whose scaled magnitude exceeds fmt.max (they saturate to ±max);
    underflow: non-zero elements that round to 0. A few reductions, no host sync.
    `saturate=False` is the caller's promise that no |x·scale| exceeds max — true when
    the scale came from an amax ≥ max |x|, since amax·scale ≤ max exactly — and skips
    the clamp and the overflow count (0). `count=False`: q alone (counts None), without
    the counting passes and their temporaries — the same q.
    """
    dtype = fmt.torch_dtype
    if dtype is None:
        raise ValueError(f"{fmt.name} has no torch dtype to quantise into")
    # one fp32 temporary: a half-precision x is widened once and scaled in place
    xs = x * scale if x.dtype == torch.float32 else x.to(torch.float32).mul_(scale)
    if not count:
        if saturate:
            xs.clamp_(-fmt.max_finite, fmt.max_finite)
        return xs.to(dtype), None
    over = torch.zeros((), dtype=torch.int64, device=x.device)
    if saturate:
        over = torch.count_nonzero(xs.abs() > fmt.max_finite)
        xs = xs.clamp_(-fmt.max_finite, fmt.max_finite)
    q = xs.to(dtype)
    # a zero's magnitude bits are all 0 in both formats (integer test: float8 ops are few);
    # saturation creates no zeros, so underflow = non-zeros before − non-zeros after
    under = torch.count_nonzero(xs) - torch.count_nonzero(q.view(torch.uint8) & 0x7F)
    return q, torch.stack((over, under))


class FP8Stats:
    """Per-step overflow/underflow counts of every converted tensor class, plus the hook
    that ends a step for the delayed recipe's histories.

    `counts` is an int64 (3, 2) tensor on the model's device — rows `TENSOR_CLASSES`,
    columns (overflow, underflow) — that the FP8 linears add to without a host sync;
    `snapshot()` reads it once.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.counts = torch.zeros(len(TENSOR_CLASSES), 2, dtype=torch.int64, device=device)
        self.modules: list[torch.nn.Module] = []  # the converted layers reporting here
        # Whether casts count this step (the engine decides per step: counting costs a
        # few passes per cast, and reading the counts a sync and an all-reduce)
        self.counting = True

    def add(self, cls_index: int, counts: Tensor) -> None:
        self.counts[cls_index] += counts

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{"input": {"overflow": n, "underflow": m}, "weight": ..., "grad_output": ...}."""
        rows = self.counts.tolist()
        return {c: {"overflow": int(o), "underflow": int(u)}
                for c, (o, u) in zip(TENSOR_CLASSES, rows)}

    def reset(self) -> None:
        """Forget everything since the last `end_step`: the counts, and the delayed layers'
        pending amaxes (call it after an evaluation pass, which is no training step)."""
        self.counts.zero_()
        for m in self.modules:
            pending = getattr(m, "fp8_amax_pending", None)
            if pending is not None:
                pending.zero_()

    def end_step(self, reduce_max: Callable[[Tensor], object] | None = None,
                 reduce_sum: Callable[[Tensor], object] | None = None
                 ) -> dict[str, dict[str, int]] | None:
        """Call once per optimizer step, after backward: returns the step's counts (None
        when this step did not count), resets them, and rolls every delayed layer's amax
        history.

        `reduce_max(t)` / `reduce_sum(t)` all-reduce a tensor in place across data-parallel
        ranks (MAX for the pending amaxes, all layers in one tensor; SUM for the counts),
        so every rank keeps the same history and logs the global counts.
        """
        delayed = [m for m in self.modules if getattr(m, "fp8_amax_history", None) is not None]
        if delayed:
            pending = torch.stack([m.fp8_amax_pending for m in delayed])
            if reduce_max is not None:
                reduce_max(pending)
            for m, p in zip(delayed, pending):
                m.roll_history(p)
        snap = None
        if self.counting:
            if reduce_sum is not None:
                reduce_sum(self.counts)
            snap = self.snapshot()
        self.reset()
        return snap
