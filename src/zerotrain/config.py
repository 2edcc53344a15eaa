"""One typed configuration tree for everything a run needs.

Loaded from YAML/JSON, then overridden from the command line with dotted keys
(`--optimizer.lr 3e-4`). Every user mistake becomes one `ConfigError` that names the
field and the fix, never a traceback from deep inside pydantic.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A user-caused configuration problem; the message says what and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Reference GPT size. Byte-level tokens, so vocab_size is 256 unless data says otherwise."""

    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=1)
    block_size: int = Field(128, ge=2, description="context length (sequence length)")
    vocab_size: int = Field(256, ge=2)
    mlp_ratio: int = Field(4, ge=1)
    bias: bool = True
    tie_weights: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    activation_checkpointing: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        return self


class DataConfig(_Section):
    path: str | None = Field(
        None, description="text file, folder of text files, or .bin from `zerotrain prepare`; "
        "None = the embedded corpus (this interpreter's standard-library sources)"
    )
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    micro_batch_size: int = Field(16, ge=1, description="sequences per rank per micro-step")
    grad_accum_steps: int = Field(1, ge=1)


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
    decay_1d: bool = Field(False, description="apply weight decay to biases and norm gains too")
    compile: bool | Literal["auto"] = Field(
        "auto", description="Adam/AdamW: run the update through torch.compile as one fused "
        "pass (as fast as torch's fused kernel; costs seconds of compilation and ~150 MiB "
        "for the compiler at start). auto: only when this rank's optimizer holds at least "
        "2^24 parameters, where that one-off cost is repaid within a few hundred steps"
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_choice(cls, v: Any) -> bool | str:
        # "auto", or anything pydantic reads as a bool (true/1/yes/on ...), with one message
        # for a bad value instead of pydantic's one per member of the union
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            return TypeAdapter(bool).validate_python(v)
        except ValidationError:
            raise ValueError(f"optimizer.compile must be true, false or auto, got {v!r}") from None

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"optimizer.betas must lie in [0, 1), got {list(self.betas)}")
        if self.nesterov and self.name == "sgd" and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("optimizer.nesterov needs optimizer.momentum > 0 and dampening 0")
        return self


class ScheduleConfig(_Section):
    """warmup -> hold at peak (optimizer.lr) -> decay to min_lr; peak lr is optimizer.lr."""

    kind: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(100, ge=0)
    warmup_start_lr: float = Field(0.0, ge=0.0)
    hold_steps: int = Field(0, ge=0)
    min_lr: float = Field(1e-4, ge=0.0)
    decay_steps: int | None = Field(
        None, ge=1, description="length of the decay phase; default: the rest of train.steps"
    )
    wsd_decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="wsd: share of the steps after warmup spent decaying"
    )


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

    @model_validator(mode="after")
    def _fp8_dtype(self) -> PrecisionConfig:
        if self.fp8.enabled and self.dtype == "fp16":
            raise ValueError(
                "precision.fp8 needs precision.dtype fp32, bf16 or bf16-pure: the FP8 layers "
                "scale each tensor themselves, and fp16's loss scaling on top is not "
                "supported; use precision.dtype bf16")
        return self


class ZeroConfig(_Section):
    stage: Literal[0, 1, 2, 3] = 0
    bucket_mb: float = Field(25.0, gt=0.0, description="size of flat communication buckets")
    overlap: bool = Field(True, description="overlap gradient communication with backward")
    offload_optimizer: Literal["none", "cpu"] = "none"
    param_persistence_threshold: int = Field(
        0, ge=0, description="ZeRO-3: units with fewer elements stay gathered between uses"
    )
    prefetch: bool = Field(True, description="ZeRO-3: gather the next unit while this one runs")

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> ZeroConfig:
        if self.offload_optimizer != "none" and self.stage < 2:
            raise ValueError(
                "zero.offload_optimizer needs zero.stage 2 or 3 (it offloads the sharded "
                "gradients, master weights and optimizer states)"
            )
        return self


class CommConfig(_Section):
    algorithm: Literal["native", "ring", "auto"] = Field(
        "auto", description="native: torch.distributed's collectives; ring: zerotrain's ring "
        "over isend/irecv; auto: the ring for reduce-scatters and all-gathers of buffers >= "
        "ring_min_mb on gloo, native otherwise"
    )
    ring_min_mb: float = Field(2.0, gt=0.0, description="auto: smallest buffer for the ring")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: int = Field(600, ge=10)


class CheckpointConfig(_Section):
    dir: str | None = Field(None, description="default: <logging.run_dir>/checkpoints")
    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    keep: int = Field(2, ge=1, description="how many recent checkpoints to keep")


class LoggingConfig(_Section):
    run_dir: str = "runs/default"
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=0, description="0 disables periodic validation")
    eval_batches: int = Field(8, ge=1)
    plot: bool = True
    sample_tokens: int = Field(300, ge=0)
    progress: bool = True


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1)
    seed: int = 1337
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: cores / local ranks)"
    )


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        s = self.schedule
        if s.warmup_steps + s.hold_steps > self.train.steps:
            raise ValueError(
                f"schedule.warmup_steps + schedule.hold_steps ({s.warmup_steps + s.hold_steps}) "
                f"exceed train.steps ({self.train.steps}); shorten warmup or train longer"
            )
        if s.kind == "wsd" and s.hold_steps:
            raise ValueError("schedule.hold_steps must be 0 for schedule.kind wsd (its stable "
                             "phase is the hold); use wsd_decay_fraction to size the decay")
        if s.min_lr > self.optimizer.lr:
            raise ValueError(
                f"schedule.min_lr ({s.min_lr}) is above the peak optimizer.lr ({self.optimizer.lr})"
            )
        if self.optimizer.name == "muon" and self.zero.stage > 0:
            raise ValueError(
                "optimizer.name muon orthogonalises whole weight matrices, but zero.stage "
                f"{self.zero.stage} gives each rank only a flat slice of them; use zero.stage 0"
            )
        if self.precision.fp8.all_gather and self.zero.stage != 3:
            raise ValueError("precision.fp8.all_gather gathers ZeRO-3's sharded weights; it "
                             f"needs zero.stage 3 (got {self.zero.stage})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------- loading


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" — did you mean '{close[0]}'?" if close else f" (valid keys: {', '.join(options)})"


def _check_keys(data: Any, model: type[BaseModel], prefix: str = "") -> None:
    """Reject unknown keys with a 'did you mean' hint before pydantic sees them."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            options = [f"{prefix}{k}" for k in fields]
            raise ConfigError(f"unknown config key '{dotted}'{_suggest(dotted, options)}")
        ann = fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{dotted}' is a section; give it as a mapping of "
                    f"{', '.join(ann.model_fields)}"
                )
            _check_keys(value, ann, dotted + ".")


def _format_validation(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" or not loc:
            lines.append(msg)
        else:
            lines.append(f"config field '{loc}': {msg} (got {e.get('input')!r})")
    return "; ".join(lines)


def build_config(data: dict[str, Any] | None = None) -> Config:
    """Validate a nested dict into a Config, raising ConfigError on any problem."""
    data = data or {}
    _check_keys(data, Config)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing .yaml or .json")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"config file '{p}' could not be parsed: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections at the top level")
    return data


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ['--optimizer.lr', '3e-4', '--zero.stage=2'] into a nested dict."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or len(tok) <= 2:
            raise ConfigError(
                f"unexpected argument '{tok}'; overrides look like --section.key VALUE")
        body = tok[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{tok}' has no value; write {tok} VALUE")
            key, raw = body, args[i + 1]
            i += 2
        key = key.replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{tok}' conflicts with an earlier value for '{part}'")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_config(path: str | Path | None = None,
                overrides: list[str] | dict | None = None) -> Config:
    data = read_config_file(path) if path else {}
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = deep_merge(data, extra)
    return build_config(data)
