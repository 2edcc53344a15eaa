"""Muon: momentum, then Newton–Schulz orthogonalisation of the whole matrix; the rule and
the optimizer class that keeps its state.

Unlike the elementwise rules in `functional.py`, Muon needs each weight matrix whole:
`muon_direction` computes the orthogonalised update O where the matrix is, `muon_apply_`
applies it elementwise where its (master) slices are — distributed Muon (zero/muon.py)
runs the two halves on different ranks. The class `Muon` (AdamW for what is not a
matrix) shares the plumbing of the other classes in `optimizers.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from zerotrain.optim.batching import Tensors
from zerotrain.optim.batching import lists as _lists
from zerotrain.optim.functional import adamw_
from zerotrain.optim.optimizers import (
    ADAM_STATES,
    Params,
    _adam_state,
    _Base,
    _check,
    _check_betas,
    _get,
    _grads,
    _zeros,
)

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


class Muon(_Base):
    """Muon for matrices, AdamW for everything else, in one optimizer.

    A parameter takes the Muon path when its group's `use_muon` is True, or, when that
    is None (default), when it has 2+ dims. Put embeddings and the output head in a
    group with use_muon=False to give them AdamW, as Jordan et al. recommend. Both
    paths share the group's lr and weight_decay; the default `adjust_lr_fn`
    ("match_rms_adamw") scales Muon's update to AdamW's RMS so that works (see
    `muon_lr`). Muon state is torch.optim.Muon's `momentum_buffer`; the AdamW
    tensors keep `step`, `exp_avg`, `exp_avg_sq`.

    A group with `defer_update=True` holds stand-ins for matrices whose weights live
    elsewhere (ZeRO shards; see zero/muon.py): the step updates their momentum and leaves
    the orthogonalised update O in each stand-in, for the caller to apply with
    `muon_apply_` where the weights are.
    """

    elementwise = False

    def __init__(self, params: Params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5,
                 adjust_lr_fn: str | None = "match_rms_adamw",
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 use_muon: bool | None = None, defer_update: bool = False,
                 ns_tf32: bool = False) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check(ns_steps >= 1, f"ns_steps must be >= 1, got {ns_steps}")
        _check(adjust_lr_fn in (None, "original", "match_rms_adamw"),
               f"adjust_lr_fn must be 'match_rms_adamw', 'original' or None, got {adjust_lr_fn!r}")
        _check_betas(adamw_betas, "adamw_betas")
        super().__init__(params, dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            use_muon=use_muon, defer_update=defer_update, ns_tf32=ns_tf32))

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """4: the momentum of each matrix. Tensors on the AdamW fallback carry 8, so this
        is exact only when those (biases, norms; embeddings if excluded) are negligible."""
        return 4

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        flag = group["use_muon"]
        mats = [p for p in params if (p.ndim >= 2 if flag is None else flag)]
        rest = [p for p in params if not (p.ndim >= 2 if flag is None else flag)]
        if mats:
            self._update_matrices(group, mats)
        if rest:
            compact = self.compact.active
            for p in rest:
                if compact:
                    self._compact_state(p, ADAM_STATES, step=True)
                else:
                    self._state(p, _adam_state)
            beta1, beta2 = group["adamw_betas"]
            for (_, step), ps in self._count_step(rest).items():
                kw = dict(step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                          eps=group["adamw_eps"], weight_decay=group["weight_decay"])
                if compact:
                    self._compact_run(lambda P, G, M, V, kw=kw: adamw_(P, G, M, V, **kw), ps,
                                      ADAM_STATES, counted=True)
                else:
                    adamw_(ps, _grads(ps), _get(ps, self.state, "exp_avg"),
                           _get(ps, self.state, "exp_avg_sq"), **kw)

    def _update_matrices(self, group: dict[str, Any], mats: list[Tensor]) -> None:
        ns = dict(momentum=group["momentum"], nesterov=group["nesterov"],
                  ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
                  eps=group["eps"], tf32=group["ns_tf32"])
        apply = dict(lr=group["lr"], weight_decay=group["weight_decay"],
                     adjust_lr_fn=group["adjust_lr_fn"], **ns)

        def deferred(P: list[Tensor], G: list[Tensor], B: list[Tensor]) -> None:
            for p, g, b in zip(P, G, B):
                p.copy_(muon_direction(g, b, **ns))

        def direct(P: list[Tensor], G: list[Tensor], B: list[Tensor]) -> None:
            muon_(P, G, B, **apply)

        rule = deferred if group["defer_update"] else direct
        if self.compact.active:  # each matrix whole: Newton–Schulz needs all of it
            for p in mats:
                self._compact_state(p, ("momentum_buffer",))
            self._compact_run(rule, mats, ("momentum_buffer",), whole=True)
            return
        for p in mats:
            self._state(p, lambda p: {"momentum_buffer": _zeros(p)})
        rule(mats, _grads(mats), _get(mats, self.state, "momentum_buffer"))
