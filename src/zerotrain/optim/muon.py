"""Muon's update rule: momentum, then Newton–Schulz orthogonalisation of the whole matrix.

Unlike the elementwise rules in `functional.py` (which re-exports these), Muon needs each
weight matrix whole: `muon_direction` computes the orthogonalised update O where the
matrix is, `muon_apply_` applies it elementwise where its (master) slices are —
distributed Muon (zero/muon.py) runs the two halves on different ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from zerotrain.optim.batching import Tensors
from zerotrain.optim.batching import lists as _lists

MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


# ----------------------------------------------------------------------------- Muon


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    eps: float = 1e-7,
    tf32: bool = False,
) -> Tensor:
    """Approximate U·Vᵀ of G = U·S·Vᵀ with the quintic Newton–Schulz iteration.

    X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X after scaling G to Frobenius norm 1 (so every
    singular value is ≤ 1). The coefficients trade exactness for speed: singular
    values land in roughly [0.7, 1.2] rather than at 1, which Muon does not mind.
    Tensors with more than two dims are treated as (shape[0], rest) matrices.

    `tf32`: on CUDA, run the iteration's fp32 GEMMs on TF32 tensor cores (~8× IEEE
    fp32 on A100/H100), whatever the process-wide setting; the engine asks for it in
    half-precision runs, whose own matmuls are coarser anyway. Nothing changes on the CPU.
    """
    a, b, c = coefficients
    X = G.reshape(G.shape[0], -1)
    wide = X.shape[0] <= X.shape[1]
    if not wide:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm() + eps)
    with tf32_matmuls(tf32 and X.is_cuda and X.dtype == torch.float32):
        for _ in range(steps):
            A = X @ X.mT
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    if not wide:
        X = X.mT
    return X.reshape(G.shape)


@contextmanager
def tf32_matmuls(on: bool) -> Iterator[None]:
    """fp32 matmuls in TF32 inside the block (when `on`), the caller's setting after."""
    if not on:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def muon_lr(lr: float, shape: Sequence[int], adjust_lr_fn: str | None) -> float:
    """Per-matrix lr for Muon's orthogonalised update (which has unit singular values).

    "match_rms_adamw" (Liu et al. 2025, our default): η·0.2·√max(rows, cols) gives the
    update the RMS of a typical AdamW update, so one lr and weight decay serve both the
    matrices and the AdamW-fallback tensors of the same optimizer. "original" (Jordan
    2024): η·√max(1, rows/cols), with Muon lrs around 0.02. None: η unchanged.
    """
    rows, cols = shape[0], math.prod(shape[1:])
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn is None:
        return lr
    raise ValueError(f"adjust_lr_fn must be 'match_rms_adamw', 'original' or None, "
                     f"got {adjust_lr_fn!r}")


def muon_(
    param: Tensors,
    grad: Tensors,
    momentum_buffer: Tensors,
    *,
    lr: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = "match_rms_adamw",
    tf32: bool = False,
) -> None:
    """Muon for matrices: θ ← θ(1 − η·λ) − η'·NS(u), u = momentum (or its Nesterov look-ahead).

    The buffer is an EMA, b ← μ·b + (1−μ)·g, like torch.optim.Muon, so its state loads
    there; that is the paper's b ← μ·b + g times (1−μ), and NS normalises scale away.
    """
    for p, g, buf in zip(*_lists(param, grad, momentum_buffer)):
        o = muon_direction(g, buf, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                           ns_coefficients=ns_coefficients, eps=eps, tf32=tf32)
        muon_apply_(p, o, p.shape, lr=lr, weight_decay=weight_decay,
                    adjust_lr_fn=adjust_lr_fn)


# Muon's two halves. Distributed Muon (zero/muon.py) runs them on different ranks: the
# direction where the whole matrix is, the elementwise apply where its master slices are.


def muon_direction(
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    eps: float = 1e-7,
    tf32: bool = False,
) -> Tensor:
    """One matrix's momentum step (the buffer in place) and its orthogonalised update O."""
    if grad.ndim < 2:
        raise ValueError(f"Muon orthogonalises matrices; got a {grad.ndim}-D tensor "
                         "(give 1-D tensors to the AdamW fallback)")
    momentum_buffer.lerp_(grad, 1 - momentum)
    u = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    return newton_schulz(u, ns_steps, ns_coefficients, eps, tf32)


def muon_apply_(param: Tensor, direction: Tensor, shape: Sequence[int], *, lr: float,
                weight_decay: float = 0.0,
                adjust_lr_fn: str | None = "match_rms_adamw") -> None:
    """θ ← θ(1 − η·λ) − η'·O, elementwise: `param` and `direction` may be the whole
    matrix or any matching slice of it; `shape` is the whole matrix's, which sets η'."""
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-muon_lr(lr, shape, adjust_lr_fn))
