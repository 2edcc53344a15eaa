"""Update rules as in-place functions on tensors: the one implementation of each rule.

Every optimizer class, and every ZeRO shard (a flat fp32 slice of the master buffer),
calls these functions, so the arithmetic of each rule lives in exactly one place: a
private `_*_math` function written with `torch._foreach_*` ops over lists of tensors.

How the work is cut — cache blocks on the CPU, bounded chunks on accelerators, one
fused compiled pass for Adam/AdamW — is `batching.py`; the rules here only say what
happens to one batch of tensors.

Muon's matrix rule (Newton–Schulz, not elementwise) is `muon.py`, beside its class.

Conventions follow torch.optim (weight decay as L2 for SGD/Adam/AdaGrad/RMSProp,
decoupled θ ← θ − η·λ·θ for AdamW/Lion/Muon); see SPEC.md §1 for the formulas.
"""

from __future__ import annotations

import torch

from zerotrain.optim.batching import COMPILE_MIN_ELEMENTS, Tensors, compile_broken
from zerotrain.optim.batching import compile_rule as _compiled
from zerotrain.optim.batching import lists as _lists
from zerotrain.optim.batching import run as _run

# ----------------------------------------------------------------------------- SGD


def _sgd_math(P, G, B, lr, *, momentum, dampening, nesterov, weight_decay, init):
    D = torch._foreach_add(G, P, alpha=weight_decay) if weight_decay else G
    if momentum:
        if init:  # torch starts the buffer at the first (decayed) gradient, undampened
            torch._foreach_copy_(B, D)
        else:
            torch._foreach_mul_(B, momentum)
            torch._foreach_add_(B, D, alpha=1 - dampening)
        D = torch._foreach_add(D, B, alpha=momentum) if nesterov else B
    torch._foreach_add_(P, D, alpha=-lr)


def sgd_(
    param: Tensors,
    grad: Tensors,
    momentum_buffer: Tensors | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    init: bool = False,
) -> None:
    """SGD with optional momentum: v ← γ·v + (1−d)·g; θ ← θ − η·v (or g + γ·v, Nesterov).

    `init=True` marks the buffer as fresh: like torch it then becomes g itself (no
    dampening), so a zero-filled ZeRO buffer and torch's lazily created one agree.
    """
    if momentum and momentum_buffer is None:
        raise ValueError("momentum > 0 needs a momentum_buffer")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum needs momentum > 0 and dampening 0")
    # without momentum P stands in for the buffer list: a placeholder, never touched
    P, G, B = _lists(param, grad, momentum_buffer if momentum else param)
    consts = dict(momentum=momentum, dampening=dampening, nesterov=nesterov,
                  weight_decay=weight_decay, init=init)
    _run(_sgd_math, (P, G, B), (lr,), consts)


# ----------------------------------------------------------------------------- AdaGrad


def _adagrad_math(P, G, S, clr, *, eps, weight_decay):
    if weight_decay:
        G = torch._foreach_add(G, P, alpha=weight_decay)
    torch._foreach_addcmul_(S, G, G)
    D = torch._foreach_sqrt(S)
    torch._foreach_add_(D, eps)
    torch._foreach_addcdiv_(P, G, D, value=-clr)


def adagrad_(
    param: Tensors,
    grad: Tensors,
    state_sum: Tensors,
    *,
    step: int,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
) -> None:
    """AdaGrad: G ← G + g²; θ ← θ − η_t·g/(√G + ε), η_t = η/(1 + (t−1)·lr_decay)."""
    P, G, S = _lists(param, grad, state_sum)
    clr = lr / (1 + (step - 1) * lr_decay)
    _run(_adagrad_math, (P, G, S), (clr,), dict(eps=eps, weight_decay=weight_decay))


# ----------------------------------------------------------------------------- RMSProp


def _rmsprop_math(P, G, SQ, GA, B, lr, *, alpha, eps, weight_decay, momentum, centered):
    if weight_decay:
        G = torch._foreach_add(G, P, alpha=weight_decay)
    torch._foreach_mul_(SQ, alpha)
    torch._foreach_addcmul_(SQ, G, G, 1 - alpha)
    if centered:  # variance instead of raw second moment: subtract the mean's square
        torch._foreach_lerp_(GA, G, 1 - alpha)
        D = torch._foreach_addcmul(SQ, GA, GA, -1)
        torch._foreach_sqrt_(D)
    else:
        D = torch._foreach_sqrt(SQ)
    torch._foreach_add_(D, eps)  # ε outside the square root, like torch
    if momentum > 0:
        torch._foreach_mul_(B, momentum)
        torch._foreach_addcdiv_(B, G, D)
        torch._foreach_add_(P, B, alpha=-lr)
    else:
        torch._foreach_addcdiv_(P, G, D, value=-lr)


def rmsprop_(
    param: Tensors,
    grad: Tensors,
    square_avg: Tensors,
    *,
    lr: float,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    momentum_buffer: Tensors | None = None,
    centered: bool = False,
    grad_avg: Tensors | None = None,
) -> None:
    """RMSProp: v ← α·v + (1−α)·g²; θ ← θ − η·g/(√v + ε), optionally centered/with momentum."""
    if momentum > 0 and momentum_buffer is None:
        raise ValueError("momentum > 0 needs a momentum_buffer")
    if centered and grad_avg is None:
        raise ValueError("centered=True needs a grad_avg buffer")
    # unused buffer lists get `param` as a placeholder that the math never touches
    P, G, SQ, GA, B = _lists(param, grad, square_avg, grad_avg if centered else param,
                             momentum_buffer if momentum > 0 else param)
    consts = dict(alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                  centered=centered)
    _run(_rmsprop_math, (P, G, SQ, GA, B), (lr,), consts)


# ----------------------------------------------------------------------------- Adam / AdamW


def _adam_math(P, G, M, V, decay, denom_scale, denom_eps, *, beta1, beta2, l2, decoupled,
               update):
    # θ ← θ − s·m/(√v/c2 + ε) is rewritten as θ ← θ − m/D with D = √v·(1/(c2·s)) + ε/s,
    # so the step-dependent scalars are plain multiplicands (see module docstring).
    if l2:
        G = torch._foreach_add(G, P, alpha=l2)
    if decoupled:
        torch._foreach_mul_(P, decay)
    torch._foreach_lerp_(M, G, 1 - beta1)
    torch._foreach_mul_(V, beta2)
    torch._foreach_addcmul_(V, G, G, 1 - beta2)
    if update:
        D = torch._foreach_sqrt(V)
        torch._foreach_mul_(D, denom_scale)
        torch._foreach_add_(D, denom_eps)
        torch._foreach_addcdiv_(P, M, D, -1.0)


def _adam(P, G, M, V, step, lr, beta1, beta2, eps, weight_decay, decoupled, compiled):
    if step < 1:
        raise ValueError(f"step counts updates from 1, got {step}")
    bc1 = 1 - beta1**step  # bias corrections: m and v start at 0
    bc2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bc1
    update = step_size != 0  # lr 0 (first warmup step): moments move, θ does not
    decay = 1 - lr * weight_decay
    scale = 1 / (bc2_sqrt * step_size) if update else 1.0
    denom_eps = eps / step_size if update else 1.0
    consts = _adam_consts(beta1, beta2, weight_decay, decoupled, update)
    _run(_adam_math, (P, G, M, V), (decay, scale, denom_eps), consts, compiled)


def _adam_consts(beta1: float, beta2: float, weight_decay: float, decoupled: bool,
                 update: bool) -> dict:
    return dict(beta1=beta1, beta2=beta2, l2=0.0 if decoupled else weight_decay,
                decoupled=decoupled and weight_decay != 0, update=update)


def adam_compile_probe(device: torch.device, dtype: torch.dtype, *, beta1: float,
                       beta2: float, weight_decay: float, decoupled: bool) -> str | None:
    """Compile the Adam/AdamW kernel now, on small stand-in tensors: None when it works,
    else why not.

    Run before any real update so that ranks can agree (`optim.build_optimizer`): a rank
    whose compile fails (a cache race, a timeout, no memory) would run eager while the
    others run compiled, and the two round differently — stage-0 replicas, which are
    never re-synchronised, would drift apart. The stand-ins take the same dtype, device
    and constants as the real tensors, so the real calls reuse this compilation.
    """
    if compile_broken():
        return "torch.compile of the optimizer step failed earlier in this process"
    ts = [[torch.zeros(COMPILE_MIN_ELEMENTS, dtype=dtype, device=device)] for _ in range(4)]
    scalars = [torch.tensor(1.0, dtype=torch.float64, device=device) for _ in range(3)]
    try:
        _compiled(_adam_math)(*ts, *scalars,
                              **_adam_consts(beta1, beta2, weight_decay, decoupled, True))
    except Exception as e:  # whatever the compiler raises: the answer is "no"
        return f"{e!r:.200}"
    return None


def adam_(
    param: Tensors,
    grad: Tensors,
    exp_avg: Tensors,
    exp_avg_sq: Tensors,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    compiled: bool = False,
) -> None:
    """Adam with weight decay as L2 (g ← g + λ·θ), exactly torch.optim.Adam's convention.

    `step` is the number of this update (1 for the first), used for bias correction.
    """
    P, G, M, V = _lists(param, grad, exp_avg, exp_avg_sq)
    _adam(P, G, M, V, step, lr, beta1, beta2, eps, weight_decay, False, compiled)


def adamw_(
    param: Tensors,
    grad: Tensors,
    exp_avg: Tensors,
    exp_avg_sq: Tensors,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    compiled: bool = False,
) -> None:
    """AdamW: Adam plus decoupled decay θ ← θ − η·λ·θ, independent of the gradient scale."""
    P, G, M, V = _lists(param, grad, exp_avg, exp_avg_sq)
    _adam(P, G, M, V, step, lr, beta1, beta2, eps, weight_decay, True, compiled)


# ----------------------------------------------------------------------------- Lion


def _lion_math(P, G, M, lr, decay, *, beta1, beta2, weight_decay):
    C = torch._foreach_mul(M, beta1)  # c = β1·m + (1−β1)·g: interpolation for the sign
    torch._foreach_add_(C, G, alpha=1 - beta1)
    torch._foreach_sign_(C)
    if weight_decay:
        torch._foreach_mul_(P, decay)
    torch._foreach_add_(P, C, alpha=-lr)
    torch._foreach_mul_(M, beta2)  # the state tracks g with the slower β2
    torch._foreach_add_(M, G, alpha=1 - beta2)


def lion_(
    param: Tensors,
    grad: Tensors,
    exp_avg: Tensors,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
) -> None:
    """Lion (Chen et al. 2023): θ ← θ − η·(sign(β1·m + (1−β1)·g) + λ·θ); m ← β2·m + (1−β2)·g.

    Every coordinate moves by exactly ±η, so Lion wants a 3-10x smaller lr than AdamW.
    """
    P, G, M = _lists(param, grad, exp_avg)
    consts = dict(beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    _run(_lion_math, (P, G, M), (lr, 1 - lr * weight_decay), consts)


__all__ = [
    "adagrad_", "adam_", "adam_compile_probe", "adamw_", "lion_", "rmsprop_", "sgd_",
]
