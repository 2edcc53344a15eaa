"""Sequence tiling: the loss head and the MLP computed `sequence.tile_tokens` tokens at a time.

At long sequences the largest tensors are not the weights but the `[tokens × vocabulary]`
logits (and their fp32 softmax) and the MLP's `[tokens × intermediate]` activations.
Both are position-wise, so they can be computed in tiles of N tokens, with the backward
recomputing each tile from the input it kept:

- `tiled_lm_loss`: cross-entropy of `hidden @ head.T` without materialising the logits.
  Forward keeps only the (final-normed) hidden states; backward recomputes one tile's
  logits, turns them into `softmax − one-hot` and feeds both matmuls. The mean is over
  the targets that are not `ignore_index`, as `F.cross_entropy` takes it.
- `tiled_mlp`: any position-wise module (`[..., C] → [..., C']`) run tile by tile with
  no graph kept; backward re-runs one tile under autograd and asks `torch.autograd.grad`
  for that tile's input and parameter gradients, summed over the tiles (the parameters
  are inputs of the Function, so each gets one accumulated gradient per backward, as
  ZeRO's gradient hooks expect).

`apply_tiling(model, plan, N)` switches it on for the reference GPT, llama, Hugging Face
causal LMs wrapped by `model.hf`, and a raw Hugging Face causal LM given to
`zerotrain.initialize` (its `forward(..., labels=...)` then returns an output whose
`loss` is set and whose `logits` are None). The user's model code is never edited: the
wrappers are instance attributes, like activation checkpointing's (models/checkpointing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100
_TILED = "_zerotrain_tiled"


def _tiles(n: int, tile: int) -> range:
    return range(0, n, tile)


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                targets: Tensor, tile: int, ignore_index: int) -> Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a in _tiles(h.shape[0], tile):
            z = F.linear(h[a:a + tile], weight, bias).float()
            total += F.cross_entropy(z, t[a:a + tile], ignore_index=ignore_index,
                                     reduction="sum")
            del z
        # a slice with no target (SFT prompt labels under sequence parallelism, right
        # padding) has loss sum 0 over count 0: 0, not 0/0, so its gradients stay
        # finite as F.cross_entropy's do (review 3, W-4)
        count = (t != ignore_index).sum().clamp(min=1)
        ctx.save_for_backward(hidden, weight, bias, targets, count)
        ctx.tile, ctx.ignore_index = tile, ignore_index
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        hidden, weight, bias, targets, count = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        # accumulated in fp32 (review 3, W-5: rounding the sum to bf16 once per tile
        # drifts as √tiles); an fp32 weight's in place (no fresh [V × C] per tile)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if need_b else None
        scale = grad.float() / count
        for a in _tiles(h.shape[0], ctx.tile):
            ht, tt = h[a:a + ctx.tile], t[a:a + ctx.tile]
            p = torch.softmax(F.linear(ht, weight, bias).float(), dim=-1)
            valid = tt != ctx.ignore_index
            rows = torch.arange(tt.shape[0], device=tt.device)
            p[rows, tt.clamp(min=0)] -= 1.0
            p.mul_((valid.float() * scale).unsqueeze(1))
            dz = p.to(h.dtype)
            if gh is not None:
                gh[a:a + ctx.tile] = dz @ weight
            if gw is not None:
                if weight.dtype == torch.float32:
                    gw.addmm_(dz.t(), ht)
                else:
                    gw += dz.t() @ ht
            if gb is not None:
                gb += dz.sum(0).float()
            del p, dz  # before the next tile's logits: one tile's [N × V] pair at a time
        return (gh.view_as(hidden) if gh is not None else None,
                gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None else None, None, None, None)


def tiled_lm_loss(hidden: Tensor, head: nn.Module, targets: Tensor, tile: int,
                  ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean FP32 cross-entropy of `head(hidden)` against `targets` (already aligned with
    `hidden`: position i predicts targets[i]), `tile` tokens at a time."""
    weight, bias = head.weight, getattr(head, "bias", None)
    return _TiledLoss.apply(hidden, weight, bias, targets, tile, ignore_index)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], tile: int, x: Tensor,
                *params: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out: Tensor | None = None
        for a in _tiles(flat.shape[0], tile):  # written in place: no list of tiles to cat
            y = fn(flat[a:a + tile])
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])
            out[a:a + tile] = y
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x)
        assert out is not None
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        params = ctx.fn.params  # the module's parameters (also this Function's inputs)
        need_x = ctx.needs_input_grad[2]
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gx = torch.empty_like(flat) if need_x else None
        acc: dict[int, Tensor] = {}
        for a in _tiles(flat.shape[0], ctx.tile):
            xt = flat[a:a + ctx.tile].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(xt)
            inputs = ([xt] if need_x else []) + [params[i] for i in want]
            got = torch.autograd.grad(y, inputs, g[a:a + ctx.tile], allow_unused=True)
            if need_x:
                assert gx is not None
                gx[a:a + ctx.tile] = got[0]
                got = got[1:]
            for i, gi in zip(want, got):  # summed in place, in fp32 (review 3, W-5)
                if gi is not None:
                    if i in acc:
                        acc[i].add_(gi)
                    else:
                        acc[i] = gi.float() if gi.is_floating_point() else gi
        out = [acc[i].to(params[i].dtype) if i in acc else None for i in range(len(params))]
        return (None, None, gx.view_as(x) if gx is not None else None, *out)


def tiled_mlp(module: nn.Module, forward: Callable[[Tensor], Tensor], x: Tensor,
              tile: int) -> Tensor:
    """`forward(x)` (a position-wise module's original forward) in tiles of `tile`
    tokens: no `[tokens × intermediate]` tensor beyond one tile, in forward or backward."""
    if x.reshape(-1, x.shape[-1]).shape[0] <= tile:
        return forward(x)
    params = [p for p in module.parameters()]
    fn = _Bound(forward, params)
    return _TiledMLP.apply(fn, tile, x, *params)


class _Bound:
    """The module's forward, carrying its parameters to the backward."""

    def __init__(self, forward: Callable[[Tensor], Tensor], params: list[Tensor]):
        self.forward, self.params = forward, params

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x)
