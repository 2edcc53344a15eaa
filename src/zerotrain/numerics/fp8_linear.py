"""A linear layer that multiplies in FP8, and the swap of a model's linears for it.

Forward: y = x̂ · ŵᵀ + b, with x̂, ŵ the input and weight quantised to E4M3
(`numerics.fp8`). Backward: the output gradient g is quantised to E5M2 (two more
exponent bits: gradients span a wider range than values), then
    grad_input  = ĝ · ŵ        grad_weight = ĝᵀ · x̂        grad_bias = Σ g (fp32)
reusing the FP8 x̂ and ŵ saved by forward (1 byte per element of activation memory).

Rowwise scales sit on the rows of x (tokens) and of w (output features). In the
backward products those rows become the reduction dimension, where a scale cannot be
applied after the sum; so they are folded into g before it is quantised (g / s_w per
column for grad_input, g / s_x per row for grad_weight), and g is quantised once per
product, per row of its own operand — as torchao's rowwise recipe casts g twice.

The layer keeps nn.Linear's own `weight` and `bias` Parameters (the very objects, same
names and shapes), so optimizers, ZeRO's flat buffers and checkpoints see no
difference; master weights stay wherever they were. The delayed recipe adds one
persistent buffer, `fp8_amax_history` (3 × amax_history: input, weight, grad_output),
which a checkpoint saves like any buffer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from zerotrain.numerics.formats import FloatFormat
from zerotrain.numerics.fp8 import (
    FP8_E4M3,
    FP8_E5M2,
    FP8Recipe,
    FP8Stats,
    amax,
    quantize,
    scale_from_amax,
)
from zerotrain.numerics.fp8_mm import fp8_mm

__all__ = ["Fp8Linear", "convert_to_fp8", "revert_fp8"]

_INPUT, _WEIGHT, _GRAD = 0, 1, 2  # rows of FP8Stats.counts and of the amax history


class Fp8Linear(nn.Linear):
    """nn.Linear computing in FP8 (module docstring). Build with `from_linear`."""

    fp8_amax_history: Tensor | None
    fp8_amax_pending: Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: FP8Recipe | None = None, stats: FP8Stats | None = None,
                 device: Any = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup_fp8(recipe or FP8Recipe(), stats)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe,
                    stats: FP8Stats | None = None) -> Fp8Linear:
        """Wrap `linear`'s Parameters (shared, not copied: no new weights are made)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._setup_fp8(recipe, stats)
        return new

    def _setup_fp8(self, recipe: FP8Recipe, stats: FP8Stats | None) -> None:
        self.recipe = recipe
        self.stats = stats if stats is not None else FP8Stats(self.weight.device)
        self.stats.modules.append(self)
        if recipe.scaling != "delayed":
            self.fp8_amax_history = self.fp8_amax_pending = None
            return
        dev = self.weight.device
        self.register_buffer("fp8_amax_history", torch.zeros(3, recipe.amax_history, device=dev))
        # the running max of this step's amaxes; checkpoints are taken between steps,
        # where it is zero, so it is not saved
        self.register_buffer("fp8_amax_pending", torch.zeros(3, device=dev), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8Linear:
        # `model.to(torch.bfloat16)` casts every floating buffer; the amax history must
        # stay fp32 (a rounded-down amax would make its scale overflow), so only move it.
        keep = {n: b for n, b in self._buffers.items() if n.startswith("fp8_") and b is not None}
        super()._apply(fn, recurse)
        for n, b in keep.items():
            self._buffers[n] = b.to(self._buffers[n].device)
        dev = self.weight.device  # the shared counters follow the model to its device
        if self.stats.counts.device != dev:
            self.stats.counts = self.stats.counts.to(dev)
        return self

    def forward(self, x: Tensor) -> Tensor:
        return _Fp8LinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        r = self.recipe
        hist = f", amax_history={r.amax_history}" if r.scaling == "delayed" else ""
        return f"{super().extra_repr()}, fp8={r.scaling}{hist}, matmul={r.matmul}"

    # ---- scaling ---------------------------------------------------------------------
    def cast(self, t: Tensor, cls: int, fmt: FloatFormat, rows: bool) -> tuple[Tensor, Tensor]:
        """Quantise t for tensor class `cls`; returns (fp8 tensor, scale) and counts it."""
        current = amax(t, rows=rows)
        a = current if self.fp8_amax_history is None else self._delayed_amax(cls, current)
        s = scale_from_amax(a, fmt, self.recipe.pow2_scales)
        counting = self.stats.counting
        q, counts = quantize(t, s, fmt, saturate=self._may_saturate(current, s, fmt),
                             count=counting)
        if counts is not None:
            self.stats.add(cls, counts)
        return q, s

    def _may_saturate(self, current: Tensor, s: Tensor, fmt: FloatFormat) -> bool:
        """Whether quantize must clamp and count overflows. A scale from the tensor's own
        amax never overflows (dynamic recipes). A delayed one may; on CPU a host check
        costs nothing and usually spares two passes, on an accelerator it would stall."""
        if self.fp8_amax_history is None:
            return False
        if current.device.type != "cpu":
            return True
        return bool((current * s > fmt.max_finite).any())

    def _delayed_amax(self, cls: int, current: Tensor) -> Tensor:
        """The history's max (previous steps); the current amax while the history is empty.

        The current amax only joins the step's running max here; `roll_history` records it
        at the end of the step, so every micro-step and every activation-checkpoint
        recompute of one step sees the same scale.
        """
        assert self.fp8_amax_history is not None and self.fp8_amax_pending is not None
        pending = self.fp8_amax_pending[cls]
        pending.copy_(torch.maximum(pending, current))
        past = self.fp8_amax_history[cls].max()
        return torch.where(past > 0, past, current)

    @torch.no_grad()
    def roll_history(self, step_amax: Tensor) -> None:
        """Append this step's amaxes (3,) as the newest entry; a non-finite one is not
        recorded (0 = no information), so one bad step cannot poison the next ones."""
        assert self.fp8_amax_history is not None and self.fp8_amax_pending is not None
        h = self.fp8_amax_history
        h.copy_(torch.roll(h, 1, dims=1))
        h[:, 0] = torch.where(torch.isfinite(step_amax), step_amax, torch.zeros_like(step_amax))
        self.fp8_amax_pending.zero_()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any
                              ) -> None:
        # Checkpoints cross recipes: a history of another length keeps its newest entries,
        # a missing one starts empty, and a layer without history ignores a saved one.
        key = prefix + "fp8_amax_history"
        mine = self.fp8_amax_history
        saved = state_dict.get(key)
        if mine is None:
            state_dict.pop(key, None)
        elif saved is None:
            state_dict[key] = mine.detach().clone()
        elif saved.shape != mine.shape:
            fitted = torch.zeros_like(mine)
            n = min(saved.shape[-1], mine.shape[-1])
            fitted[:, :n] = saved[:, :n]
            state_dict[key] = fitted
        super()._load_from_state_dict(state_dict, prefix, *args)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,
                mod: Fp8Linear) -> Tensor:
        rows = mod.recipe.scaling == "rowwise"
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = mod.cast(x2, _INPUT, FP8_E4M3, rows)
        w8, sw = mod.cast(weight, _WEIGHT, FP8_E4M3, rows)
        y = fp8_mm(x8, sx, w8.t(), sw.t() if rows else sw, mod.recipe.matmul)
        if bias is not None:
            y = y + bias.to(torch.float32)  # bias in high precision
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.mod, ctx.x_shape, ctx.x_dtype = mod, x.shape, x.dtype
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x8, sx, w8, sw = ctx.saved_tensors
        mod: Fp8Linear = ctx.mod
        g2 = g.reshape(-1, g.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if mod.recipe.scaling == "rowwise":
            gx, gw = _rowwise_grads(mod, g2, x8, sx, w8, sw, need_x, need_w)
        else:
            g8, sg = mod.cast(g2, _GRAD, FP8_E5M2, rows=False)
            mm = mod.recipe.matmul
            gx = fp8_mm(g8, sg, w8, sw, mm) if need_x else None
            gw = fp8_mm(g8.t(), sg, x8, sx, mm) if need_w else None
        grad_x = gx.to(ctx.x_dtype).reshape(ctx.x_shape) if gx is not None else None
        grad_w = gw.to(ctx.w_dtype) if gw is not None else None
        grad_b = None
        if need_b and ctx.b_dtype is not None:
            grad_b = g2.to(torch.float32).sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None


def _rowwise_grads(mod: Fp8Linear, g2: Tensor, x8: Tensor, sx: Tensor, w8: Tensor,
                   sw: Tensor, need_x: bool, need_w: bool) -> tuple[Tensor | None, ...]:
    """Backward products with per-row scales folded into g (module docstring)."""
    mm = mod.recipe.matmul
    gx = gw = None
    g32 = g2.to(torch.float32)
    if need_x:  # (M, N) @ (N, K): w's row scales run along N
        ga8, sga = mod.cast(g32 / sw.t(), _GRAD, FP8_E5M2, rows=True)
        gx = fp8_mm(ga8, sga, w8, None, mm)
    if need_w:  # (N, M) @ (M, K): x's row scales run along M
        gb8, sgb = mod.cast((g32 / sx).t(), _GRAD, FP8_E5M2, rows=True)
        gw = fp8_mm(gb8, sgb, x8, None, mm)
    return gx, gw


class _HasFp8Linears(Protocol):
    fp8_linears: tuple[str, ...]


def convert_to_fp8(model: nn.Module, plan: _HasFp8Linears, cfg: Any) -> FP8Stats:
    """Swap the nn.Linear modules named by `plan.fp8_linears` for `Fp8Linear`, in place.

    `cfg`: an `FP8Config` (precision.fp8) or an `FP8Recipe`. Parameters are shared, not
    copied. Convert before a ZeRO strategy wraps the model, so its hooks and units see the
    final modules. Returns the stats object all converted layers report to.
    """
    recipe = cfg if isinstance(cfg, FP8Recipe) else FP8Recipe.from_config(cfg)
    first = next(model.parameters(), None)
    stats = FP8Stats(first.device if first is not None else None)
    for name in plan.fp8_linears:
        parent, attr = _parent(model, name)
        old = getattr(parent, attr)
        if isinstance(old, Fp8Linear):
            raise ValueError(f"'{name}' is already an Fp8Linear; convert a model once")
        if type(old) is not nn.Linear:
            raise TypeError(f"plan.fp8_linears names '{name}', a {type(old).__name__}; "
                            "only plain nn.Linear modules convert to FP8")
        setattr(parent, attr, Fp8Linear.from_linear(old, recipe, stats))
    return stats


def revert_fp8(model: nn.Module) -> int:
    """Swap every Fp8Linear back for an nn.Linear with the same Parameters; returns how
    many (a delayed layer's amax history is dropped)."""
    names = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    for name in names:
        parent, attr = _parent(model, name)
        old = getattr(parent, attr)
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = old.in_features, old.out_features
        lin.weight = old.weight
        lin.register_parameter("bias", old.bias)
        lin.train(old.training)
        old.stats.modules.remove(old)
        setattr(parent, attr, lin)
    return len(names)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    head, _, attr = name.rpartition(".")
    return (model.get_submodule(head) if head else model), attr
