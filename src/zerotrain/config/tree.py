"""The whole configuration tree, and the checks that span sections."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from zerotrain.config.base import _Section
from zerotrain.config.model import DataConfig, ModelConfig
from zerotrain.config.run import (
    CheckpointConfig,
    CommConfig,
    LoggingConfig,
    TrainConfig,
    ZeroConfig,
)
from zerotrain.config.sequence import SequenceConfig, check_sequence_parallel
from zerotrain.config.training import (
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
    default_warmup,
)


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sequence: SequenceConfig = Field(default_factory=SequenceConfig)
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
        if "warmup_steps" not in s.model_fields_set:
            # the default scales with a short run (a 6-step smoke test must not be refused
            # for a warmup nobody asked for); left out of fields_set, so still "defaulted"
            object.__setattr__(s, "warmup_steps", default_warmup(self.train.steps))
        if s.warmup_steps + s.hold_steps > self.train.steps:
            most = max(0, self.train.steps - s.hold_steps)
            raise ValueError(
                f"schedule.warmup_steps ({s.warmup_steps}) + schedule.hold_steps "
                f"({s.hold_steps}) exceed train.steps ({self.train.steps}); set "
                f"--schedule.warmup_steps {min(most, default_warmup(self.train.steps))} "
                f"(at most {most}"
                + (", or lower schedule.hold_steps" if s.hold_steps else "")
                + ") or raise train.steps")
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
        if (muon := _muon_problem(self)) is not None:
            raise ValueError(muon)
        if self.zero.param_wire == "fp8" and not self.precision.fp8.enabled:
            raise ValueError("zero.param_wire fp8 sends the FP8 linears' weights; it needs "
                             "precision.fp8.enabled true (or use zero.param_wire int8)")
        if self.precision.fp8.all_gather and self.zero.param_wire == "int8":
            raise ValueError("precision.fp8.all_gather (= zero.param_wire fp8) and "
                             "zero.param_wire int8 are two wires for the same gather; pick one")
        zpp = [f for f, on in (("secondary_partition", self.zero.secondary_partition),
                                ("grad_wire", self.zero.grad_wire != "plain")) if on]
        if zpp and self.sequence.parallel > 1:
            raise ValueError(f"zero.{zpp[0]} places groups by node over every rank; it does not "
                             "combine with sequence.parallel > 1 yet: remove one of them")
        if self.precision.fp8.all_gather and self.zero.stage != 3:
            raise ValueError("precision.fp8.all_gather gathers ZeRO-3's sharded weights; it "
                             f"needs zero.stage 3 (got {self.zero.stage})")
        if s.decay_steps is not None and s.kind != "constant":
            end = (s.decay_start if s.decay_start is not None
                   else s.warmup_steps + s.hold_steps) + s.decay_steps
            if s.kind != "wsd" and end > self.train.steps:
                raise ValueError(
                    f"schedule.decay_steps ({s.decay_steps}) ends the decay at step {end}, "
                    f"after train.steps ({self.train.steps}): the run would stop before "
                    "reaching schedule.min_lr; shorten decay_steps or leave it null")
        m = self.model
        # block_size only when given: library mode's batches need not follow the default
        # (their length is checked per batch); the CLI checks it at launch too
        check_sequence_parallel(self.sequence.parallel, n_head=m.n_head or None,
                                seq_len=m.block_size if "block_size" in m.model_fields_set
                                else None)
        no_effect = idle_settings(self)
        if no_effect:
            raise ValueError("; ".join(no_effect))
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _muon_problem(cfg: Config) -> str | None:
    """Why Muon cannot run with this config's other settings, if it cannot."""
    if cfg.optimizer.name != "muon":
        return None
    if cfg.zero.offload_optimizer == "nvme":
        return ("optimizer.name muon with zero.offload_optimizer nvme: the disk tier streams "
                "elementwise optimizer states unit by unit and Muon updates whole matrices; "
                "use zero.offload_optimizer cpu or none with Muon")
    if cfg.model.moe is not None:
        return ("optimizer.name muon with model.moe: Muon would orthogonalise a layer's fused "
                "experts [E, 2I, d] as one matrix, not expert by expert; use optimizer.name "
                "adamw")
    return None


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
    out += _idle_tier_settings(z)
    if cfg.data.eos_token_id is not None and not cfg.data.document_mask:
        out.append(f"data.eos_token_id ({cfg.data.eos_token_id}) is used by "
                   "data.document_mask only; remove it or set data.document_mask true")
    return out


def _idle_tier_settings(z: Any) -> list[str]:
    """The disk tier's settings without a disk tier, and the tiers' read-ahead without
    any tier: they would do nothing."""
    out, default = [], type(z).model_fields
    tiers = [t for t in (z.offload_param, z.offload_optimizer) if t != "none"]
    if "nvme" not in tiers:
        for name in ("nvme_path", "nvme_threads", "nvme_block_mb", "nvme_direct"):
            value = getattr(z, name)
            if value != default[name].default:
                out.append(f"zero.{name} ({value}) is used by the nvme tiers only (zero."
                           "offload_param or zero.offload_optimizer nvme); remove it or set "
                           "one of them to nvme")
    if not tiers and z.offload_prefetch != default["offload_prefetch"].default:
        out.append(f"zero.offload_prefetch ({z.offload_prefetch}) is used by the offload "
                   "tiers only (zero.offload_param or zero.offload_optimizer); remove it")
    return out
