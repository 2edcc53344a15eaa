"""torch.optim.Adam / AdamW's own arithmetic on zerotrain's shards, bit for bit.

What a DeepSpeed run updates with when the client hands it a torch optimizer — the HF
Trainer's `torch.optim.AdamW` (`fused=True` by default with torch >= 2.8): DeepSpeed's
ZeRO optimizer points the client optimizer's groups at its flat fp32 partitions and calls
its `step()`. zerotrain's own AdamW (`functional.adamw_`) computes the same formula in
another order and parts from it in the last bit after a few updates, so under the
DeepSpeed surface (`zerotrain.deepspeed`, a client Adam/AdamW) the groups carry
`arithmetic: "torch"` or `"torch_fused"` and `Adam._update` comes here:

- `"torch"` (the client's `fused` off: torch's single-tensor or foreach loop): torch's own
  functional `torch.optim.adam.adam` runs on the shard views; it is elementwise and gives
  the same bits whatever the cut (checked in tests/test_torch_rule.py).
- `"torch_fused"` on an accelerator: torch's fused kernel itself (elementwise too).
- `"torch_fused"` on the CPU: torch's fused CPU kernel computes the body of each tensor
  in SIMD registers and its last `numel % width` elements (8 or 16) in a scalar loop that
  rounds differently. The result therefore depends on where a tensor ends — DeepSpeed's
  partitions end elsewhere than zerotrain's shards. Here the SIMD body's operations are
  replayed one by one with torch ops that round as its instructions do (the compiler
  contracts `v·β2 + ((1−β2)·g)·g` into one fused multiply-add; the square root is the
  correctly rounded one, which torch.sqrt on the CPU is not): equal to the kernel for
  every element of a tensor whose length is a multiple of the width, and independent of
  the cut. Only elements that fall in DeepSpeed's own scalar tail (the last few of a
  partition whose length is not a multiple of 16) can differ, in the last bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

#: the group values of `arithmetic` this module implements
RULES = ("torch", "torch_fused")
#: elements per pass on the CPU (the temporaries of a block stay in cache)
_BLOCK = 1 << 18


def arithmetic_of(group: dict) -> str:
    """The arithmetic a torch Adam/AdamW group dict steps with: "torch_fused" or "torch"."""
    return "torch_fused" if group.get("fused") else "torch"


def torch_adam_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    rule: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """One Adam (decoupled=False) or AdamW update as torch.optim computes it; `steps`
    (0-d float32 tensors, torch's `state["step"]`) are incremented as torch does."""
    if rule not in RULES:
        raise ValueError(f"arithmetic {rule!r}: one of {', '.join(RULES)}")
    hyper = dict(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled
    )
    if rule == "torch_fused" and all(p.device.type == "cpu" for p in params):
        _fused_cpu(params, grads, exp_avgs, exp_avg_sqs, steps, hyper)
        return
    fused = rule == "torch_fused"
    # torch's fused kernels want the step counters on the parameters' device
    counters = (
        [st.to(p.device) for st, p in zip(steps, params, strict=True)] if fused else list(steps)
    )
    _torch_adam(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        counters,
        foreach=False if not fused else None,
        fused=fused,
        capturable=False,
        differentiable=False,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=decoupled,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
    if fused:
        for st, c in zip(steps, counters, strict=True):
            st.copy_(c)


def _fused_cpu(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    hyper: dict,
) -> None:
    """torch's fused CPU update, replayed block by block (cut-independent)."""
    for st in steps:
        st += 1
    for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        for a in range(0, p.numel(), _BLOCK):
            b = min(a + _BLOCK, p.numel())
            fused_cpu_block_(*(t.view(-1)[a:b] for t in (p, g, m, v)), step=float(st), **hyper)


def _sqrt_rounded(v: Tensor) -> Tensor:
    """The correctly rounded square root (the SIMD instruction's); torch.sqrt on the CPU
    goes through a vector math library that is off by one ulp in ~17% of elements."""
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    np.sqrt(v.detach().contiguous().numpy(), out=out.numpy())
    return out


def fused_cpu_block_(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """The SIMD body of torch's fused CPU Adam/AdamW kernel, operation by operation, on
    fp32 tensors (in place on p, m, v). Constants are computed in double as the kernel
    does and rounded to fp32 where it builds its vectors."""
    bc1 = 1 - beta1**step
    bc2_sqrt = math.sqrt(1 - beta2**step)
    step_size = lr / bc1
    if weight_decay:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:  # g + θ·λ, contracted into one fused multiply-add
            g = torch.addcmul(g, p, torch.tensor(weight_decay, dtype=p.dtype))
    m.lerp_(g, 1 - beta1)  # torch's lerp: the kernel's blend + fused multiply-add
    v.mul_(beta2)
    v.addcmul_(g * (1 - beta2), g)  # fma((1−β2)·g, g, v·β2)
    d = _sqrt_rounded(v)
    d.div_(bc2_sqrt).add_(eps)
    u = m * -step_size
    u.div_(d)
    p.add_(u)
