"""optimizer:, schedule: and precision: — how the weights are updated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from zerotrain.config.base import _Section

OptimizerName = Literal["adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "muon"]



class OptimizerConfig(_Section):
    name: OptimizerName = "adamw"
    lr: float = Field(1e-3, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0.0)
    momentum: float = Field(
        0.0, ge=0.0, lt=1.0, description="SGD/RMSProp momentum; Muon uses 0.95 if 0"
    )
    dampening: float = Field(0.0, ge=0.0, le=1.0)
    nesterov: bool | None = Field(
        None, description="SGD/Muon Nesterov momentum; null = the optimizer's default "
        "(off for SGD, on for Muon)"
    )
    alpha: float = Field(0.99, gt=0.0, lt=1.0, description="RMSProp smoothing")
    lr_decay: float = Field(0.0, ge=0.0, description="AdaGrad lr decay")
    ns_steps: int = Field(5, ge=1, description="Muon Newton-Schulz iterations")
    grad_clip: float | None = Field(1.0, description="clip by global norm; null/0 disables")
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw", description="Muon's per-matrix lr: match_rms_adamw = lr·0.2·√max(rows, "
        "cols) (one lr serves matrices and the AdamW fallback); original = lr·√max(1, rows/cols) "
        "(Jordan's, DeepSpeed's; Muon lrs near 0.02)"
    )
    decay_1d: bool = Field(False, description="apply weight decay to biases and norm gains too")
    state_dtype: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="how optimizer states are stored (AdamW/Adam, Lion, SGD and "
        "Muon momentum): fp32; bf16; int8 = block-wise quantised, one fp32 scale per 256 "
        "elements, a dynamic (non-linear) map, second moments as sqrt(v); the update runs "
        "in fp32 on dequantised chunks (docs/compact-states.md)"
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="Adam/AdamW: run the update through torch.compile as one fused "
        "pass (as fast as torch's fused kernel; costs seconds of compilation and ~150 MiB "
        "for the compiler at start). auto: only when this rank's optimizer holds at least "
        "2^24 parameters, where that one-off cost is repaid within a few hundred steps. "
        "With compact states (state_dtype bf16/int8, bf16 masters with kahan/stochastic) it "
        "true also compiles their (de)quantisation and rounding, any optimizer (the same "
        "numbers as eager; auto leaves them eager, which measured faster on CPU)"
    )

    @field_validator("grad_clip")
    @classmethod
    def _clip(cls, v: float | None) -> float | None:
        if v is not None and v < 0:  # a negative clip flips every gradient: ascent
            raise ValueError(f"optimizer.grad_clip must be > 0 (or null/0 to disable), got {v}")
        return v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError(f"optimizer.betas takes two numbers, written [0.9,0.95] (YAML "
                             f"list) on the command line; got the text {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"optimizer.betas must lie in [0, 1), got {list(self.betas)}")
        if self.nesterov and self.name == "sgd" and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("optimizer.nesterov needs optimizer.momentum > 0 and dampening 0")
        if self.state_dtype != "fp32" and self.name in ("adagrad", "rmsprop"):
            raise ValueError(f"optimizer.state_dtype {self.state_dtype} is implemented for "
                             f"adamw, adam, lion, sgd and muon, not {self.name}; use "
                             "optimizer.state_dtype fp32")
        return self

    def state_note(self) -> str | None:
        """A note when optimizer.state_dtype has nothing to store (plain SGD)."""
        if self.state_dtype != "fp32" and self.name == "sgd" and self.momentum == 0:
            return (f"[zerotrain] optimizer.state_dtype {self.state_dtype}: SGD without "
                    "momentum keeps no optimizer state, so there is nothing to store "
                    "compactly; running as configured")
        return None


#: warmup of a run that does not set schedule.warmup_steps: this many steps, or a tenth
#: of a shorter run (`default_warmup`)
DEFAULT_WARMUP = 100


def default_warmup(steps: int) -> int:
    """schedule.warmup_steps when not given: DEFAULT_WARMUP, at most a tenth of the run."""
    return min(DEFAULT_WARMUP, steps // 10)


class ScheduleConfig(_Section):
    """warmup -> hold at peak (optimizer.lr) -> decay to min_lr; peak lr is optimizer.lr.

    warmup_steps left unset is `default_warmup(train.steps)`: 100, or a tenth of a run
    shorter than 1000 steps (the Config fills it in; alone, a section says 100).

    These defaults are the command line's; `build_config(..., library=True)` (what
    `zerotrain.initialize` uses) starts from LIBRARY_DEFAULTS instead: a constant lr.
    """

    kind: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(DEFAULT_WARMUP, ge=0, description="default: 100, or a "
                              "tenth of train.steps when that is less")
    warmup_type: Literal["linear", "log"] = Field(
        "linear", description="warmup curve: linear in the step, or log(step+1)/log(warmup_steps) "
        "(DeepSpeed's default)")
    warmup_start_lr: float = Field(0.0, ge=0.0)
    hold_steps: int = Field(0, ge=0)
    min_lr: float = Field(1e-4, ge=0.0)
    decay_steps: int | None = Field(
        None, ge=1, description="length of the decay phase; default: the rest of train.steps"
    )
    wsd_decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="wsd: share of the steps after warmup spent decaying"
    )
    decay_start: int | None = Field(
        None, ge=0, description="cosine/linear: step the decay phase starts from; default "
        "warmup_steps + hold_steps. warmup_steps - 1 gives DeepSpeed's WarmupCosineLR, whose "
        "first step after warmup is already one step into the cosine"
    )

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        if self.warmup_type == "log" and self.warmup_steps == 1:
            raise ValueError("schedule.warmup_type log needs schedule.warmup_steps >= 2 (its "
                             "curve divides by log(warmup_steps)); use 0 or >= 2")
        if self.decay_start is not None:
            if self.kind not in ("cosine", "linear"):
                raise ValueError(f"schedule.decay_start applies to kind cosine or linear, not "
                                 f"{self.kind}; remove it")
            if self.hold_steps:
                raise ValueError("schedule.decay_start replaces warmup_steps + hold_steps as the "
                                 "start of the decay; set hold_steps 0 or drop decay_start")
        return self


class LossScaleConfig(_Section):
    kind: Literal["dynamic", "static"] = "dynamic"
    init_scale: float = Field(2.0**16, gt=0.0)
    window: int = Field(1000, ge=1, description="clean steps before the scale doubles")
    hysteresis: int = Field(2, ge=1, description="overflows tolerated before backing off")
    min_scale: float = Field(1.0, gt=0.0)
    on_min_scale: Literal["error", "clamp"] = "error"


class FP8Config(_Section):
    """FP8 compute for the blocks' linear layers (E4M3 forward, E5M2 gradients).

    Which layers convert is the model's `Plan.fp8_linears`; master weights and the
    optimizer are untouched (the layers cast their weights on the fly).
    """

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "delayed"] = Field(
        "tensorwise", description="scale per tensor, per row, or from an amax history")
    amax_history: int = Field(16, ge=1, description="delayed: steps of amax history kept")
    all_gather: bool = Field(False, description="ZeRO-3: all-gather the FP8 linears' "
                             "weights in FP8 (1 byte/element) instead of the param dtype")
    pow2_scales: bool = Field(True, description="round scales down to a power of two, so "
                              "scaling and unscaling are exact")
    count_every: int = Field(
        0, ge=0, description="count overflows/underflows (a few extra passes per cast, a "
        "sync and an all-reduce per counted step) every k steps; 0: on the steps the "
        "training loop logs (logging.log_every, and the last)")
    matmul: Literal["auto", "scaled_mm", "emulate"] = Field(
        "auto", description="auto: torch._scaled_mm on a CUDA device where it works, else "
        "emulate (dequantise, multiply in fp32; on CPU _scaled_mm is no faster)")

    @model_validator(mode="after")
    def _gather_needs_fp8(self) -> FP8Config:
        if self.all_gather and not self.enabled:
            raise ValueError("precision.fp8.all_gather needs precision.fp8.enabled true")
        return self


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16", "bf16-pure"] = "fp32"
    grad_accum_dtype: Literal["fp32", "compute"] = Field(
        "fp32", description="dtype gradients accumulate in across micro-steps"
    )
    reduce_dtype: Literal["fp32", "compute"] = Field(
        "fp32", description="dtype gradients are communicated in"
    )
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)
    fp8: FP8Config = Field(default_factory=FP8Config)
    master_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="dtype of the weights the optimizer updates. null: fp32 for "
        "dtype bf16/fp16 (a separate fp32 master), bf16 for bf16-pure. bf16 (with dtype "
        "bf16): the bf16 parameters are the masters, updated by master_update")
    master_update: Literal["kahan", "stochastic", "plain"] | None = Field(
        None, description="how bf16 masters take an update: kahan = a bf16 compensation "
        "buffer keeps what rounding dropped (2 bytes/param); stochastic = rounded up or "
        "down at random, unbiased (0 bytes); plain = round to nearest (small updates are "
        "lost). null: kahan, or plain for bf16-pure")
    tf32: bool | Literal["auto"] = Field(
        "auto", description="fp32 matrix multiplies on TF32 tensor cores "
        "(torch.set_float32_matmul_precision('high')), about 8x faster on A100/H100 at a "
        "10-bit mantissa; auto: on for precision.dtype fp32 on CUDA, untouched otherwise")

    @model_validator(mode="after")
    def _fp8_dtype(self) -> PrecisionConfig:
        if self.fp8.enabled and self.dtype == "fp16":
            raise ValueError(
                "precision.fp8 needs precision.dtype fp32, bf16 or bf16-pure: the FP8 layers "
                "scale each tensor themselves, and fp16's loss scaling on top is not "
                "supported; use precision.dtype bf16")
        return self

    @model_validator(mode="after")
    def _masters(self) -> PrecisionConfig:
        if self.master_dtype == "bf16" and self.dtype in ("fp16", "fp32"):
            raise ValueError(
                f"precision.master_dtype bf16 needs precision.dtype bf16, not {self.dtype}: "
                + ("fp16 compute keeps fp32 masters (its loss scaling and 5-bit exponent "
                   "need them)" if self.dtype == "fp16" else "fp32 parameters are their "
                   "own fp32 masters") + "; set precision.dtype bf16 or master_dtype fp32")
        if self.dtype == "bf16-pure" and self.master_dtype == "fp32":
            raise ValueError("precision.dtype bf16-pure means bf16 masters; for fp32 masters "
                             "use precision.dtype bf16")
        if self.dtype == "bf16-pure" and self.master_update not in (None, "plain"):
            raise ValueError(
                f"precision.dtype bf16-pure is bf16 masters with master_update plain; for "
                f"{self.master_update} use precision.dtype bf16 with master_dtype bf16")
        if self.master_update is not None and self.bf16_masters is False:
            raise ValueError("precision.master_update applies to bf16 masters only; set "
                             "precision.master_dtype bf16 (with dtype bf16) or remove it")
        return self

    @property
    def bf16_masters(self) -> bool:
        """Whether the optimizer updates bf16 weights (no fp32 copy anywhere)."""
        return self.dtype == "bf16-pure" or self.master_dtype == "bf16"

    @property
    def update_rule(self) -> str:
        """How masters take updates: none (fp32 masters), plain, kahan or stochastic."""
        if not self.bf16_masters:
            return "none"
        return self.master_update or ("plain" if self.dtype == "bf16-pure" else "kahan")
