"""Whole-gradient operations as one multi-tensor kernel per device and dtype.

A ZeRO strategy keeps its gradients in units (hundreds to thousands for a large model
with small buckets). The norm, the unscale/clip multiply and the zeroing of every step
are then one tiny kernel per unit — launch-bound on a GPU. `torch._foreach_*` does each
in one launch per (device, dtype) group, whatever the number of units.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def _groups(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.numel():
            out.setdefault((t.device, t.dtype), []).append(t)
    return out


def sum_of_squares(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Σ ‖t‖² over `tensors`, a 0-d float64 tensor on `device`.

    Each tensor's norm is taken in fp32 (as `vector_norm(t, dtype=torch.float32)`), then
    squared and summed in fp64, so many units cannot lose the small ones' contributions.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in _groups(tensors).values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        total += torch.stack(norms).double().square().sum().to(device)
    return total


def scale_(tensors: Sequence[Tensor], factor: float) -> None:
    """t *= factor for every tensor, in place, rounding exactly as `t.mul_(factor)`.

    The factor goes in as a 0-d CPU tensor: with a plain Python number the CPU foreach
    kernel rounds it to a half-precision tensor's dtype first, and results would differ
    from `mul_`'s in bf16 (a CPU 0-d tensor is also read on the host under CUDA: no copy).
    """
    if factor == 1.0:
        return
    f = torch.tensor(factor, dtype=torch.float64)
    for group in _groups(tensors).values():
        torch._foreach_mul_(group, f)


def zero_(tensors: Sequence[Tensor]) -> None:
    """t = 0 for every tensor, in place."""
    for group in _groups(tensors).values():
        torch._foreach_zero_(group)
