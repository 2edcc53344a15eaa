"""Which dtype each model-state tensor lives in (SPEC §4).

Mixed precision (`bf16`, `fp16`): the model's parameters are half precision and run
forward/backward; an FP32 master copy is what the optimizer updates, because an update
η·g smaller than half an ulp of a half-precision weight would round away to nothing.
`fp32`: the parameters are their own master. `bf16-pure`: half-precision parameters
*and* no master — the documented contrast that shows small updates vanishing.

Compact states (docs/compact-states.md): `precision.master_dtype: bf16` makes the bf16
parameters the masters too, updated by `precision.master_update` (kahan: a bf16
compensation kept as optimizer state; stochastic; plain — bf16-pure is bf16 + plain);
`optimizer.state_dtype` (fp32, bf16, int8) is how the optimizer stores its moments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.config import OptimizerConfig, PrecisionConfig
from zerotrain.numerics.compact import FP32, Compact

_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "bf16-pure": torch.bfloat16,
}


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype  # storage and compute dtype of the model's parameters
    master_dtype: torch.dtype | None  # None: the optimizer updates the parameters themselves
    grad_dtype: torch.dtype  # gradients accumulate across micro-steps in this dtype
    reduce_dtype: torch.dtype  # gradients travel between ranks in this dtype
    loss_scaling: bool  # fp16 only: its 5-bit exponent flushes small gradients
    #: optimizer.state_dtype and how bf16 masters take updates (optim/compact.py)
    compact: Compact = FP32

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, optimizer: OptimizerConfig | None = None
                    ) -> PrecisionPolicy:
        """`optimizer`: where optimizer.state_dtype comes from (fp32 without it)."""
        param = _DTYPES[cfg.dtype]
        mixed = cfg.dtype in ("bf16", "fp16") and not cfg.bf16_masters
        grad = torch.float32 if cfg.grad_accum_dtype == "fp32" else param
        red = torch.float32 if cfg.reduce_dtype == "fp32" else param
        compact = Compact(optimizer.state_dtype if optimizer else "fp32", cfg.update_rule)
        return cls(cfg.dtype, param, torch.float32 if mixed else None, grad, red,
                   cfg.dtype == "fp16", compact)

    @property
    def state_dtype(self) -> str:
        return self.compact.state_dtype

    @property
    def master_update(self) -> str:
        return self.compact.master_update

    @property
    def stored_state_dtype(self) -> str:
        """The dtype optimizer states really have: optimizer.state_dtype, except that
        fp32 states beside bf16 weights without a master (bf16-pure, plain) are made
        like the weights, in bf16 (torch.optim's zeros_like)."""
        if self.state_dtype == "fp32" and not self.compact.active and \
                self.master_dtype is None and self.param_dtype == torch.bfloat16:
            return "bf16"
        return self.state_dtype

    @property
    def has_master(self) -> bool:
        return self.master_dtype is not None

    def describe(self) -> str:
        def n(d: torch.dtype | None) -> str:
            return str(d).removeprefix("torch.") if d is not None else "none (params are updated)"

        return (
            f"{self.name}: params {n(self.param_dtype)}, master {n(self.master_dtype)}, "
            f"grads accumulate in {n(self.grad_dtype)}, reduce in {n(self.reduce_dtype)}"
            + (", dynamic loss scaling" if self.loss_scaling else "")
            + (f", bf16 masters updated {self.master_update}"
               if self.master_update not in ("none", "plain") else "")
            + (f", optimizer states {self.state_dtype}" if self.state_dtype != "fp32" else "")
        )


def matmul_precision(tf32: bool | str, device: torch.device, dtype: str) -> str | None:
    """The `torch.set_float32_matmul_precision` value `precision.tf32` asks for, or None
    to leave torch's (process-wide) setting alone.

    TF32 keeps fp32's range with a 10-bit mantissa (`zerotrain float 0.1 --format tf32`);
    on A100/H100 tensor cores it runs fp32 matrix multiplies ~8x faster, and PyTorch
    leaves it off by default. "auto" turns it on where it matters — fp32 compute on
    CUDA — and in half precision changes nothing (those matmuls are bf16/fp16 anyway).
    """
    if tf32 == "auto":
        return "high" if device.type == "cuda" and dtype == "fp32" else None
    return "high" if tf32 else "highest"


def apply_tf32(tf32: bool | str, device: torch.device, dtype: str) -> str | None:
    """Set fp32 matmul precision for this process (once, at engine start); returns the
    value set, or None when left alone."""
    value = matmul_precision(tf32, device, dtype)
    if value is not None:
        torch.set_float32_matmul_precision(value)
    return value
