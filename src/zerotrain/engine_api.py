"""The common subset of DeepSpeed's engine API on zerotrain's own Engine. A script written
against DeepSpeed itself (its `initialize`, optimizer groups, scheduler timing and
checkpoint flags) runs unchanged through `zerotrain.deepspeed` instead.

    engine.get_lr(), engine.get_global_grad_norm(), engine.global_steps,
    engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
    engine.module, engine.optimizer, engine.lr_scheduler, engine.no_sync()

Everything here is a thin layer over the Engine's own state; `save_checkpoint` /
`load_checkpoint` are the Engine's own methods (engine.py), under DeepSpeed's names.
What differs from DeepSpeed is said in docs/from-deepspeed.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Schedule:
    """`engine.lr_scheduler`: the stateless schedule seen as a scheduler object.

    The engine sets each step's lr itself (a pure function of the step, so resume needs
    only the step); this object reports it the way torch/DeepSpeed schedulers do.
    """

    def __init__(self, engine: Any):
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        e = self._engine
        return [e.lr_at(max(e.global_step - 1, 0))] * len(e.optimizer.param_groups)

    def get_lr(self) -> list[float]:
        """The lr the next update will use."""
        e = self._engine
        return [e.lr_at(e.global_step)] * len(e.optimizer.param_groups)

    def state_dict(self) -> dict[str, int]:
        return {"step": self._engine.global_step}


class DeepSpeedAPI:
    """Mixed into `Engine`; see the module docstring."""

    @property
    def global_steps(self) -> int:
        return self.global_step

    @property
    def lr_scheduler(self) -> Schedule:
        return Schedule(self)

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer group at the last step (as DeepSpeed)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step, before clipping."""
        return None if self.last_info is None else self.last_info.grad_norm

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.data.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def train_batch_size(self) -> int:
        return self.config.data.micro_batch_size * self.accum * self.dp_size  # SP: world / S

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without communicating (stages 0–1).

        ZeRO-2/3 keep only a gradient shard, so their gradients must be reduced every
        micro-step: there, as in DeepSpeed, no_sync is an error. Calling `step()` inside
        is an error too.
        """
        if self.strategy.grads.every_micro_step:
            raise RuntimeError(f"no_sync() is not possible with {self.strategy.name}: "
                               "ZeRO-2/3 reduce gradients every micro-step to keep only "
                               "the shard; use data.grad_accum_steps instead")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False
