"""The engine: one object that composes model, strategy, precision, optimizer and schedule.

    engine = zerotrain.initialize(model, config)
    for micro_batch in ...:
        loss = engine(x, y)
        engine.backward(loss)
        info = engine.step()      # None except on accumulation boundaries

The engine never looks at the ZeRO stage: the config picks a Strategy class and the
engine only calls the Strategy interface. The order of one optimizer step is the
textbook one — finish gradient traffic, global norm (overflow = non-finite norm, the
same on every rank), unscale and clip in one multiply, update, publish weights.

It is Stateful (`state_dict` / `load_state_dict`, torch DCP's pattern): checkpoints
save and restore it without reaching inside. DeepSpeed's common engine methods are
in `engine_api.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotrain.checkpoint import Loaded, load, save
from zerotrain.checkpoint.module_state import aliases, buffers, rng_state, set_rng_state
from zerotrain.comm.collectives import Comm
from zerotrain.comm.dist import bind_device, patient_barrier
from zerotrain.config import Config
from zerotrain.engine_api import DeepSpeedAPI
from zerotrain.memory import PhasePeaks, phase_estimates
from zerotrain.memory.host import PINNED, mmap_threshold, return_freed_blocks
from zerotrain.models import Plan, long_sequence, plan_for
from zerotrain.models.ulysses import SequenceParallel
from zerotrain.numerics.fp8_linear import convert_to_fp8
from zerotrain.numerics.guard import SpikeGuard
from zerotrain.numerics.precision import PrecisionPolicy, apply_tf32
from zerotrain.numerics.scaler import LossScaler
from zerotrain.optim import build_optimizer, is_elementwise
from zerotrain.optim.groups import group_hyperparameters
from zerotrain.optim.schedule import lr_from_config
from zerotrain.zero import Strategy, WeightReader, build_strategy, run_shape, swap_lazy

#: optimizer steps during which each phase's peak memory is measured
PHASE_STEPS = 2


@dataclass
class StepInfo:
    step: int            # optimizer steps completed (including skipped ones)
    lr: float
    grad_norm: float     # global L2 norm of the unscaled gradient, before clipping
    skipped: bool        # True when the update was skipped (non-finite, or a spike)
    loss_scale: float
    skipped_total: int
    spike: str | None = None  # why the spike guard skipped this step, if it did
    fp8: dict | None = None   # FP8 overflow/underflow counts, all ranks (counted steps)


class Engine(DeepSpeedAPI):
    def __init__(self, model: nn.Module, config: Config, device: torch.device | None = None,
                 plan: Plan | None = None, weights: WeightReader | None = None):
        """`model` may live on the meta device: the strategy materialises it unit by unit
        (ZeRO-3: one unit at a time, keeping only this rank's shard). `weights`: pretrained
        values, read slice by slice (`read(name, start, stop)`), instead of initial ones."""
        self.config = config
        # this rank's device, current before anything (the Comm's NCCL device included)
        if device is None:
            device = bind_device(config.train.device)
        elif device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        # freed host blocks go back to the OS (long-sequence runs, by default)
        return_freed_blocks(mmap_threshold(config.train.host_mmap_mb, config.sequence))
        self.phases = PhasePeaks(self.device)  # peaks of init, forward, backward, step, save
        self.phases.begin()
        self.policy = PrecisionPolicy.from_config(config.precision, config.optimizer)
        apply_tf32(config.precision.tf32, device, config.precision.dtype)
        c = config.comm
        self.comm = Comm(c.algorithm, ring_min_bytes=int(c.ring_min_mb * 2**20),
                         check_lockstep=c.check_lockstep, timeout_s=c.timeout_s,
                         grad_group=c.grad_group, node_size=c.node_size)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.module = model
        self._lay_out(model, plan, weights)
        groups = self.strategy.param_groups(self.group_options())
        self.optimizer = build_optimizer(config.optimizer, groups, self.policy.compact,
                                         agree=self._agree if self.world_size > 1 else None)
        self.scaler = LossScaler(config.precision.loss_scale, enabled=self.policy.loss_scaling)
        self.accum = config.data.grad_accum_steps
        self.micro_step = 0
        self.global_step = 0
        self.last_info: StepInfo | None = None
        self._no_sync = False
        self.extra_meta: dict[str, Any] = {}  # saved with checkpoints (e.g. the tokenizer)
        self.run_id: str | None = None  # the run's id, saved with (and pruning) its checkpoints
        self.last_load: Loaded | None = None  # what the last load_checkpoint read
        self.spike_guard = SpikeGuard(config.train.spike_guard) \
            if config.train.spike_guard.enabled else None
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses
        self.phases.end("init")
        self.last_traffic: dict = {}
        self.last_traffic_bytes = self.last_inter_bytes = (0, 0)  # sent, received
        # ZeRO-Infinity: bytes each offload tier read and wrote in the last step
        self.last_tier_bytes: dict[str, dict[str, int]] = {}
        # step -> lr replacing the schedule (lr-find's ramp); None: the configured schedule
        self.lr_override: Callable[[int], float] | None = None

    # ------------------------------------------------------------------ training
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward. With `sequence.parallel` S > 1, every rank of an SP group
        passes the same whole batch — `(idx, targets)` or `input_ids=..., labels=...` —
        and the engine keeps this rank's 1/S of the length; the loss returned is the whole
        sequence's mean (logits, if returned, are this rank's slice). With
        `data.document_mask`, attention and positions stay within each packed document."""
        if self.fp8 is not None:
            self.fp8.counting = self.fp8_counts_at(self.global_step + 1)
        with self._phase("forward"):
            return long_sequence.sequence_forward(self.module, self.sp, self.docs, args, kwargs)

    def _lay_out(self, model: nn.Module, plan: Plan | None, weights: WeightReader | None
                 ) -> None:
        """The model's side of init: sequence groups, the strategy (parameters laid out,
        pretrained values read), long-sequence wiring and FP8 layers, in that order."""
        config = self.config
        # sequence.parallel > 1: groups of S ranks share each sequence (models/ulysses.py);
        # the forward slices the batch, the backward divides by the data-parallel degree
        self.sp = SequenceParallel(config.sequence.parallel, self.comm, model) \
            if config.sequence.parallel > 1 else None
        self.dp_size = self.sp.dp_size if self.sp is not None else self.world_size
        self.docs = long_sequence.document_masking(config.data, model)  # or None: off
        self.plan = plan or plan_for(model)
        self.strategy: Strategy = build_strategy(
            model, self.plan, self.policy, self.comm, config.zero, self.device,
            elementwise=is_elementwise(config.optimizer.name), pretrained=weights is not None,
            fp8_gather=config.precision.fp8.all_gather)
        if weights is not None:
            self.strategy.load_weights(weights)
        # long sequences: checkpointing of the plan's blocks, tiles of the head and MLP
        note = long_sequence.apply_long_sequence(
            model, self.plan.blocks, config.model.activation_checkpointing,
            config.sequence.tile_tokens, self.device)
        if note and self.rank == 0:
            print(note, flush=True)
        # FP8 layers share the parameters the strategy just laid out (nothing moves); their
        # amax-history buffers are made on the device
        self.fp8 = convert_to_fp8(model, self.plan, config.precision.fp8) \
            if config.precision.fp8.enabled else None

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Measure the phase's peak memory during the first optimizer steps only (a
        reset and a read of the process peak each; nothing afterwards)."""
        if self.global_step >= PHASE_STEPS or (not self.module.training and name == "forward"):
            yield
            return
        self.phases.begin()
        yield
        self.phases.end(name)

    def train(self, mode: bool = True) -> Engine:
        if mode and not self.module.training and self.fp8 is not None:
            self.fp8.reset()  # an evaluation is no training step: forget its amaxes
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def is_boundary(self) -> bool:
        return (self.micro_step + 1) % self.accum == 0

    def group_options(self) -> dict[int, dict[str, Any]]:
        """Hyper-parameters of each plan group id (the DeepSpeed layer gives its own)."""
        return group_hyperparameters(self.config)

    def apply_lr(self) -> float:
        """Set the lr of this step's update on every optimizer group and return it: the
        schedule at the step count (zerotrain.deepspeed applies DeepSpeed's sequence)."""
        lr = self.lr_at(self.global_step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def lr_at(self, step: int) -> float:
        if self.lr_override is not None:
            return self.lr_override(step)
        return lr_from_config(step, self.config.schedule, self.config.optimizer.lr,
                              self.config.train.steps)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss × scale / (accumulation × data-parallel degree).

        Folding 1/(accum·N) into the loss makes the summed reduction an average over the
        global batch with no extra pass over the gradients. N is the world size, or world
        / S with sequence parallelism: the S ranks of a group hold partial gradients of
        the same sequences, which the sum over ranks adds up whole.
        """
        self.strategy.pre_backward(self.is_boundary() and not self._no_sync)
        factor = self.scaler.scale / (self.accum * self.dp_size)
        if self.spike_guard is not None:  # kept on the device: no sync per micro-step
            d = loss.detach().float()
            self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        with self._phase("backward"), long_sequence.sequence_backward(self.sp, self.docs):
            (loss.float() * factor).backward()

    def step(self) -> StepInfo | None:
        with self._phase("step"):
            return self._step()

    def _step(self) -> StepInfo | None:
        if self._no_sync:
            raise RuntimeError("engine.step() inside no_sync(): leave the block first")
        boundary = self.is_boundary()
        self.micro_step += 1
        if not boundary:
            return None
        s = self.strategy
        s.finish_backward()
        scale = self.scaler.scale
        norm_sq = s.grad_norm_sq()
        finite = math.isfinite(norm_sq)
        grad_norm = math.sqrt(norm_sq) / scale if finite else float("inf")
        self.scaler.update(overflow=not finite)
        lr = self.apply_lr()
        spike = self._spike(grad_norm) if finite else None
        if finite and spike is None:
            clip = self.config.optimizer.grad_clip
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0  # as clip_grad_norm_
            s.scale_grads(coef / scale)
            s.optimizer_step(self.optimizer)
            s.after_step()
        s.zero_grad()
        self.global_step += 1
        self.last_traffic = self.comm.counter.snapshot()
        c = self.comm.counter  # inter: the bytes that crossed nodes
        self.last_traffic_bytes, self.last_inter_bytes, _ = c.total(), c.inter(), c.reset()
        self.last_tier_bytes = self.strategy.tier_bytes()  # offload tiers that move bytes
        skipped_total = self.scaler.skipped + (self.spike_guard.skipped if self.spike_guard
                                               else 0)
        self.last_info = StepInfo(self.global_step, lr, grad_norm, not finite or bool(spike),
                                  scale, skipped_total, spike, self._fp8_end_step())
        return self.last_info

    def fp8_counts_at(self, step: int) -> bool:
        """Whether optimizer step `step` counts FP8 overflows/underflows (StepInfo.fp8):
        every `precision.fp8.count_every` steps, or (0) the steps the loop logs."""
        every = self.config.precision.fp8.count_every or self.config.logging.log_every
        return step % every == 0 or step == self.config.train.steps

    def _agree(self, failed: bool) -> bool:
        """The compile vote: True on every rank when `failed` on any. Each rank compiles
        first (a cold compile can outlast comm.timeout_s, and on NCCL a timeout aborts),
        so the ranks meet on the store before the vote's all-reduce."""
        patient_barrier()
        return self.comm.any(failed)

    def _fp8_end_step(self) -> dict | None:
        """Roll the delayed recipe's histories (one MAX all-reduce of every layer's amax, so
        all ranks keep the same scales) and collect the step's global counts."""
        if self.fp8 is None:
            return None

        def reduce(op: str):
            def f(t: torch.Tensor) -> None:
                t.copy_(self.comm.all_reduce_scalars(t.double(), op=op).to(t))
            return f
        return self.fp8.end_step(reduce_max=reduce("max"), reduce_sum=reduce("sum"))

    def _spike(self, grad_norm: float) -> str | None:
        """The spike guard's verdict on this step (the mean loss is all-reduced first)."""
        if self.spike_guard is None:
            return None
        local = float(self._loss_sum) / self.accum if self._loss_sum is not None else 0.0
        self._loss_sum = None
        loss = float(self.comm.all_reduce_scalars([local])[0]) / self.world_size
        return self.spike_guard.check(loss, grad_norm)

    @contextmanager
    def full_parameters(self, params: Any = None) -> Iterator[None]:
        """Every parameter of `module` (or of `params`' units) usable in full inside the
        block: ZeRO-3 gathers them (a collective), other stages hold them anyway."""
        with self.strategy.full_parameters(params):
            yield

    # ------------------------------------------------------------------ state
    def state_dict(self, lazy: bool = False) -> dict[str, Any]:
        """Everything a resume needs, in this rank's own layout.

        "meta" describes that layout (units, this rank's optimizer tensors) and the model
        (parameter names, shapes, tied aliases), so a checkpoint can be checked and cut
        again for another world size or stage without the model.
        """
        away = self.strategy.lazy_states() if lazy else {}  # states in an offload tier
        strategy = self.strategy.state_dict(lazy=bool(away))
        return swap_lazy({  # `lazy`: the states in an offload tier as `zero.Lazy`
            "strategy": strategy,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "counters": {"global_step": self.global_step, "micro_step": self.micro_step,
                         "spike_guard": self.spike_guard.state_dict() if self.spike_guard
                         else None},
            "rng": rng_state(self.device),
            "buffers": buffers(self.module),
            "meta": {"layout": self.strategy.layout(),
                     "rank_layout": self.strategy.rank_layout(),
                     "aliases": aliases(self.module),
                     "optimizer": self.config.optimizer.name,
                     "config": self.config.to_dict(), "extra": self.extra_meta},
        }, away)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from a state dict in this engine's layout (see `checkpoint/`).

        Hyper-parameters (lr schedule, betas, decay …) are this run's config; the
        optimizer's *state* (moments, steps) comes from `sd`.
        """
        self.strategy.load_state_dict(sd["strategy"])
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": sd["optimizer"]["state"], "param_groups": groups})
        self.strategy.fill_optimizer(self.optimizer)  # moments away in a tier: to their homes
        self.scaler.load_state_dict(sd["scaler"])
        self.global_step = int(sd["counters"]["global_step"])
        self.micro_step = int(sd["counters"]["micro_step"])
        if self.spike_guard is not None and sd["counters"].get("spike_guard"):
            self.spike_guard.load_state_dict(sd["counters"]["spike_guard"])
        if sd.get("rng"):
            set_rng_state(sd["rng"], self.device)
        named = dict(self.module.named_buffers())
        with torch.no_grad():
            for name, value in sd.get("buffers", {}).items():
                if name in named:
                    named[name].copy_(value)

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None,
                        client_state: dict | None = None) -> Path:
        """Collective: save to `save_dir/<tag or step_N>` and point `latest` at it."""
        first = "save" not in self.phases.peaks
        if first:
            self.phases.begin()
        path = save(self.state_dict(lazy=True), save_dir, step=self.global_step, rank=self.rank,
                    world=self.world_size, keep=self.config.checkpoint.keep,
                    run_id=self.run_id, client_state=client_state, name=tag)
        if first:
            self.phases.end("save")
        return path

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None,
                        reset_optimizer: bool = False) -> tuple[Path, Any]:
        """Restore from `load_dir` (its `latest`, or `tag`) at any world size or stage;
        returns (checkpoint path, client_state)."""
        src = Path(load_dir) / tag if tag else Path(load_dir)
        sd, info = load(src, self.state_dict(lazy=True), self.rank, reset_optimizer)
        self.load_state_dict(sd)
        self.last_load = info
        return info.path, info.client_state

    def load_weights(self, read: WeightReader) -> None:
        """Set the weights from full per-parameter tensors; this rank reads only what it
        keeps (`read(name, start, stop)` gives flat elements of parameter `name`)."""
        self.strategy.load_weights(read)

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> dict[str, Any]:
        """Model-state bytes measured from the tensors this rank holds, plus process peaks."""
        from zerotrain.memory import measured_process_memory

        rep: dict[str, Any] = {
            "rank": self.rank, "world_size": self.world_size, "strategy": self.strategy.name,
            "precision": self.policy.describe(),
            "model_states": self.strategy.memory_breakdown(self.optimizer.state.values()),
            "buffer_numels": self.strategy.buffer_numels(),
            "phases": self.memory_phases(),
        }
        rep.update(measured_process_memory(self.device))
        return rep

    def memory_phases(self, activations: int = 0) -> dict[str, dict[str, int]]:
        """Each phase's peak so far above the memory before the engine, beside the
        prediction of `zero.run_shape` (as `zerotrain estimate`; on a CPU the high-water
        mark and each phase's own); `activations`: the saved ones, if the caller knows."""
        shape = run_shape(self.strategy.kind, self.config, self.module, self.plan,
                          self.device.type, self.world_size)
        high, low = (phase_estimates(replace(shape, high_water=h), activations)
                     for h in (shape.high_water, False))
        measured = {k: v - self.phases.baseline for k, v in self.phases.peaks.items()}
        return {"measured": measured, "predicted": {k: high[k] for k in measured},
                "predicted_low": {k: low[k] for k in measured}}

    def close(self) -> None:
        self.strategy.close()
        PINNED.release()  # activation offload's pinned buffers (memory/host.py)
