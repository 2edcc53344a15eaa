"""One typed configuration tree for everything a run needs.

Loaded from YAML/JSON, then overridden from the command line with dotted keys
(`--optimizer.lr 3e-4`). Every user mistake becomes one `ConfigError` that names the
field and the fix, never a traceback from deep inside pydantic.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

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
    # inf/nan never make a sensible setting (an lr of inf trains to NaN)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        # pydantic reads `true` as 1 for an int (and `--zero.stage true` as stage 1)
        if isinstance(data, dict):
            for name, value in data.items():
                f = cls.model_fields.get(name)
                if isinstance(value, bool) and f is not None and _numeric(f.annotation):
                    raise ValueError(f"{cls._section_name()}.{name} is a number, got {value!r}")
        return data

    @classmethod
    def _section_name(cls) -> str:
        return cls.__name__.removesuffix("Config").lower()


def _numeric(annotation: Any) -> bool:
    """Whether a field holds numbers only (int/float, optional, or a Literal of ints)."""
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return all(isinstance(a, int) and not isinstance(a, bool) for a in args)
    if args:
        kinds = [a for a in args if a is not type(None)]
        return bool(kinds) and all(_numeric(a) for a in kinds)
    return annotation in (int, float)


#: What each model family takes for a field left null (`_family_defaults` applies them).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"bias": True, "tie_weights": True},
    "llama": {"bias": False, "tie_weights": False},
}
#: Sizes of a model given neither a preset nor a Hugging Face folder (today's small GPT).
BASE_SIZES: dict[str, int] = {"n_layer": 4, "n_head": 4, "n_embd": 128}


def llama_intermediate_size(n_embd: int) -> int:
    """SwiGLU hidden width: 8/3 of n_embd (the same parameters as a 4x GELU MLP), rounded
    up to a multiple of 64 so matrix shapes stay friendly to kernels."""
    return -(-(8 * n_embd // 3) // 64) * 64


class ModelConfig(_Section):
    """Which model and how big. Fields left null take the preset's value (`preset`), then
    the family's default; `hf` builds any Hugging Face causal LM from a local folder."""

    arch: Literal["gpt", "llama"] | None = Field(
        None, description="gpt | llama; null: the preset's family, else gpt")
    preset: str | None = Field(
        None, description="named size (gpt-tiny, llama-60m, ...): fills the size fields left "
        "null; see zerotrain.models.presets")
    hf: str | None = Field(
        None, description="local folder with a Hugging Face config.json (and optionally "
        "safetensors weights): build that model instead of arch")
    init_from: str | None = Field(
        None, description="start from these weights: a zerotrain export (.safetensors) or a "
        "folder of safetensors (Hugging Face layout)")
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    n_kv_head: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention); null: n_head")
    n_embd: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP width; null: the family's rule (gpt: mlp_ratio*n_embd, "
        "llama: 8/3*n_embd rounded up to a multiple of 64)")
    block_size: int = Field(128, ge=2, description="context length (sequence length)")
    vocab_size: int = Field(256, ge=2, description="default: the tokenizer's vocabulary")
    mlp_ratio: int = Field(4, ge=1, description="gpt: MLP width as a multiple of n_embd")
    bias: bool | None = Field(None, description="null: the family's default (gpt yes, llama no)")
    tie_weights: bool | None = Field(
        None, description="share the token embedding with the output head; null: the "
        "family's default (gpt yes, llama no)")
    rope_theta: float = Field(10000.0, gt=0.0, description="llama: rotary base wavelength")
    norm_eps: float = Field(1e-5, gt=0.0, description="epsilon of the normalisation layers")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    activation_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """The one place a null field gets its family's value (before validation, so the
        filled values are checked like given ones)."""
        if not isinstance(data, dict):
            return data
        d = dict(data)
        if d.get("preset") is None and d.get("hf") is None:
            d["arch"] = d.get("arch") or "gpt"
            for k, v in BASE_SIZES.items():
                d[k] = v if d.get(k) is None else d[k]
        arch = d.get("arch")
        family = FAMILY_DEFAULTS.get(arch) if isinstance(arch, str) else None
        if family is None or d.get("hf") is not None:
            return d
        for k, v in family.items():
            d[k] = v if d.get(k) is None else d[k]
        n_head, n_embd = d.get("n_head"), d.get("n_embd")
        if d.get("n_kv_head") is None and isinstance(n_head, int):
            d["n_kv_head"] = n_head
        if d.get("intermediate_size") is None and isinstance(n_embd, int):
            ratio = d.get("mlp_ratio", 4)
            d["intermediate_size"] = (llama_intermediate_size(n_embd) if d["arch"] == "llama"
                                      else ratio * n_embd if isinstance(ratio, int) else None)
        return d

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hf is not None and (self.preset is not None or self.arch is not None):
            raise ValueError("model.hf builds the model its config.json describes; remove "
                             "model.preset / model.arch")
        if self.n_head and self.n_embd and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_head and self.n_kv_head and self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head ({self.n_head}) must be a multiple of "
                             f"model.n_kv_head ({self.n_kv_head})")
        if self.arch == "gpt":
            foreign = [f"model.{k} = {getattr(self, k)}" for k, ok in (
                ("n_kv_head", self.n_kv_head in (None, self.n_head)),
                ("intermediate_size", self.intermediate_size in (
                    None, self.mlp_ratio * (self.n_embd or 0))),
                ("rope_theta", self.rope_theta == 10000.0),
                ("norm_eps", self.norm_eps == 1e-5)) if not ok]
            if foreign:
                raise ValueError(f"model.arch gpt does not use {', '.join(foreign)} (GPT: "
                                 "full attention heads, mlp_ratio, learned positions, LayerNorm "
                                 "eps 1e-5); remove it or set model.arch llama")
        return self


class DataConfig(_Section):
    path: str | None = Field(
        None, description="text file, folder of text files, .jsonl/.parquet, a token-shard "
        "folder or a .bin from `zerotrain prepare`; None = the embedded corpus (this "
        "interpreter's standard-library sources)"
    )
    tokenizer: str = Field(
        "bytes", description="bytes (vocab 256), a tokenizer.json, a local Hugging Face "
        "tokenizer folder, or bpe:N (train an N-token byte-level BPE on the training text)"
    )
    text_field: str = Field("text", description=".jsonl/.parquet: the field holding the text")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    micro_batch_size: int = Field(16, ge=1, description="sequences per rank per micro-step")
    grad_accum_steps: int = Field(1, ge=1)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not str(v).strip():  # '' would read the current directory
            raise ValueError("data.path is empty; give a file or folder, or null for the "
                             "embedded corpus")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_spec(cls, v: str) -> str:
        if v.startswith("bpe:"):
            n = v[4:]
            if not n.isdigit() or int(n) < 258:
                raise ValueError(f"data.tokenizer '{v}': write bpe:N with N >= 258 (256 bytes, "
                                 "an end-of-text token and at least one merge), e.g. bpe:4096")
        elif not v:
            raise ValueError("data.tokenizer is empty; use bytes, a tokenizer path or bpe:N")
        return v


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
        return self


class ScheduleConfig(_Section):
    """warmup -> hold at peak (optimizer.lr) -> decay to min_lr; peak lr is optimizer.lr.

    These defaults are the command line's; `build_config(..., library=True)` (what
    `zerotrain.initialize` uses) starts from LIBRARY_DEFAULTS instead: a constant lr.
    """

    kind: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(100, ge=0)
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


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16", "bf16-pure"] = "fp32"
    grad_accum_dtype: Literal["fp32", "compute"] = Field(
        "fp32", description="dtype gradients accumulate in across micro-steps"
    )
    reduce_dtype: Literal["fp32", "compute"] = Field(
        "fp32", description="dtype gradients are communicated in"
    )
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)


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
    keep: int = Field(2, ge=1, description="how many recent checkpoints of this run to keep")
    reset_optimizer: bool = Field(
        False, description="on resume, start the optimizer state afresh (needed to resume "
        "with another optimizer); weights, counters and loss scale still load")


class WandbConfig(_Section):
    """Weights & Biases run naming; offline unless the WANDB_MODE environment variable says."""

    project: str = "zerotrain"
    entity: str | None = Field(None, description="team or user; None: wandb's default")
    group: str | None = None


class LoggingConfig(_Section):
    run_dir: str = "runs/default"
    backends: list[Literal["jsonl", "tensorboard", "wandb", "csv"]] = Field(
        default_factory=lambda: ["jsonl"], description="where metrics go (rank 0): jsonl "
        "(metrics.jsonl), tensorboard, wandb, csv; each but jsonl and csv is an optional extra "
        "(pip install 'zerotrain[tensorboard]')")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=0, description="0 disables periodic validation")
    eval_batches: int = Field(8, ge=1)
    plot: bool = True
    sample_tokens: int = Field(300, ge=0)
    progress: bool = True
    overwrite: bool = Field(
        False, description="start afresh in a run_dir that holds another run, deleting its "
        "checkpoints and metrics (otherwise that is refused)")

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: Any) -> Any:
        # `--logging.backends tensorboard,csv` on the command line arrives as one string
        v = [b.strip() for b in v.split(",") if b.strip()] if isinstance(v, str) else v
        if isinstance(v, list) and len(set(map(str, v))) != len(v):
            raise ValueError(f"logging.backends lists a backend twice: {v}")
        return v


class SpikeGuardConfig(_Section):
    """Skip a step whose loss or gradient norm is an outlier (off by default)."""

    enabled: bool = False
    window: int = Field(50, ge=5, description="recent steps the mean and spread come from")
    zscore: float = Field(6.0, gt=0.0, description="skip beyond this many standard deviations")


class FaultConfig(_Section):
    """Fault injection, for tests and demos of --max-restarts: SIGKILL rank `rank` when it
    completes step `step` (in the job's first attempt only; null: never)."""

    rank: int = Field(0, ge=0)
    step: int | None = Field(None, ge=1)


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1)
    seed: int = 1337
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: cores / local ranks)"
    )
    max_skipped_steps: int = Field(
        50, ge=1, description="abort after this many consecutive skipped (non-finite) steps; "
        "fp16's loss-scale search never needs as many")
    spike_guard: SpikeGuardConfig = Field(default_factory=SpikeGuardConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)


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
        if s.warmup_start_lr > self.optimizer.lr:
            raise ValueError(f"schedule.warmup_start_lr ({s.warmup_start_lr}) is above the peak "
                             f"optimizer.lr ({self.optimizer.lr})")
        if s.decay_steps is not None and s.kind != "constant":
            end = (s.decay_start if s.decay_start is not None
                   else s.warmup_steps + s.hold_steps) + s.decay_steps
            if s.kind != "wsd" and end > self.train.steps:
                raise ValueError(
                    f"schedule.decay_steps ({s.decay_steps}) ends the decay at step {end}, "
                    f"after train.steps ({self.train.steps}): the run would stop before "
                    "reaching schedule.min_lr; shorten decay_steps or leave it null")
        no_effect = idle_settings(self)
        if no_effect:
            raise ValueError("; ".join(no_effect))
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def idle_settings(cfg: Config) -> list[str]:
    """Settings given a non-default value that do nothing in this configuration."""
    o, z, out = cfg.optimizer, cfg.zero, []
    default = OptimizerConfig.model_fields

    def idle(field: str, value: Any, users: tuple[str, ...]) -> None:
        if value != default[field].default and o.name not in users:
            out.append(f"optimizer.{field} ({value}) does nothing with optimizer.name "
                       f"{o.name}; it is used by {', '.join(users)}. Remove it")

    idle("momentum", o.momentum, ("sgd", "rmsprop", "muon"))
    idle("nesterov", o.nesterov, ("sgd", "muon"))
    idle("dampening", o.dampening, ("sgd",))
    idle("alpha", o.alpha, ("rmsprop",))
    idle("lr_decay", o.lr_decay, ("adagrad",))
    idle("ns_steps", o.ns_steps, ("muon",))
    idle("muon_adjust_lr", o.muon_adjust_lr, ("muon",))
    if z.stage < 3 and z.param_persistence_threshold:
        out.append(f"zero.param_persistence_threshold ({z.param_persistence_threshold}) "
                   f"applies to zero.stage 3 only (this is stage {z.stage}); remove it")
    if z.stage < 3 and not z.prefetch:
        out.append(f"zero.prefetch false applies to zero.stage 3 only (this is stage "
                   f"{z.stage}); remove it")
    return out


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


#: Defaults of a library user (`zerotrain.initialize(model, cfg)`) that differ from the
#: command line's: a DeepSpeed or plain-PyTorch user who configures no schedule expects
#: the optimizer's lr, constant, from the first step. Anything the user sets still wins.
LIBRARY_DEFAULTS: dict[str, Any] = {
    "schedule": {"kind": "constant", "warmup_steps": 0, "min_lr": 0.0},
}


def build_config(data: dict[str, Any] | None = None, *, library: bool = False) -> Config:
    """Validate a nested dict into a Config, raising ConfigError on any problem.

    library=True starts from LIBRARY_DEFAULTS (constant lr) instead of the CLI defaults.
    """
    data = data or {}
    _check_keys(data, Config)
    if library:
        data = deep_merge(LIBRARY_DEFAULTS, data)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"key '{dup}' appears twice in one object")
    return dict(pairs)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice (YAML itself keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing .yaml or .json")
    try:
        text = p.read_text()
        data = (json.loads(text, object_pairs_hook=_unique_keys) if p.suffix == ".json"
                else yaml.load(text, Loader=_StrictLoader))
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
                overrides: list[str] | dict | None = None, *, library: bool = False) -> Config:
    data = read_config_file(path) if path else {}
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = deep_merge(data, extra)
    return build_config(data, library=library)
