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
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Comm
from zerotrain.comm.dist import init_distributed, launched_by_torchrun, pick_device
from zerotrain.config import Config, build_config
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.numerics.scaler import LossScaler
from zerotrain.optim import build_optimizer, is_elementwise
from zerotrain.optim.schedule import lr_from_config
from zerotrain.zero import Strategy, strategy_class


@dataclass
class StepInfo:
    step: int            # optimizer steps completed (including skipped ones)
    lr: float
    grad_norm: float     # global L2 norm of the unscaled gradient, before clipping
    skipped: bool        # True when a non-finite gradient made us skip the update
    loss_scale: float
    skipped_total: int


# Optimizer groups. 0: matrices (decayed; Muon's orthogonalised update), 1: biases and
# norm gains (not decayed), 2: embeddings and the output head (decayed; Muon leaves them
# to its AdamW fallback, as its authors recommend).
GROUP_OPTIONS = {0: {"decay": True}, 1: {"decay": False}, 2: {"decay": True, "use_muon": False}}


def param_grouper(model: nn.Module, cfg: Config):
    # embeddings, and an output head: a Linear child of the root that emits the vocabulary
    edge = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    edge += [m for m in model.children() if isinstance(m, nn.Linear)
             and m.out_features == cfg.model.vocab_size]
    edge_ids = {id(p) for m in edge for p in m.parameters()}

    def group_of(name: str, p: nn.Parameter) -> int:
        if p.ndim < 2 and not cfg.optimizer.decay_1d:
            return 1
        return 2 if id(p) in edge_ids else 0
    return group_of


def group_hyperparameters(cfg: Config) -> dict[int, dict[str, Any]]:
    out = {}
    for g, opt in GROUP_OPTIONS.items():
        h: dict[str, Any] = {"weight_decay": cfg.optimizer.weight_decay if opt["decay"] else 0.0}
        if cfg.optimizer.name == "muon":
            h["use_muon"] = opt.get("use_muon")  # None: Muon for 2-D, AdamW otherwise
        out[g] = h
    return out


class Engine:
    def __init__(self, model: nn.Module, config: Config, device: torch.device | None = None):
        self.config = config
        self.policy = PrecisionPolicy.from_config(config.precision)
        self.comm = Comm(config.comm.algorithm,
                         ring_min_bytes=int(config.comm.ring_min_mb * 2**20))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = device or pick_device(config.train.device, local_rank)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        model.to(device=self.device, dtype=self.policy.param_dtype)
        self.module = model
        self.strategy: Strategy = strategy_class(config.zero)(
            model, self.policy, self.comm, config.zero, self.device, param_grouper(model, config),
            keep_shapes=not is_elementwise(config.optimizer.name),
        )
        groups = self.strategy.param_groups(group_hyperparameters(config))
        self.optimizer = build_optimizer(config.optimizer, groups)
        self.strategy.optimizer = self.optimizer
        self.scaler = LossScaler(config.precision.loss_scale, enabled=self.policy.loss_scaling)
        self.accum = config.data.grad_accum_steps
        self.micro_step = 0
        self.global_step = 0
        self.last_traffic: dict = {}
        self.last_traffic_bytes = (0, 0)

    # ------------------------------------------------------------------ training
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def is_boundary(self) -> bool:
        return (self.micro_step + 1) % self.accum == 0

    def lr_at(self, step: int) -> float:
        return lr_from_config(step, self.config.schedule, self.config.optimizer.lr,
                              self.config.train.steps)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss × scale / (accumulation × world size).

        Folding 1/(accum·N) into the loss makes the summed reduction an average over the
        global batch with no extra pass over the gradients.
        """
        self.strategy.pre_backward(self.is_boundary())
        factor = self.scaler.scale / (self.accum * self.world_size)
        (loss.float() * factor).backward()

    def step(self) -> StepInfo | None:
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
        lr = self.lr_at(self.global_step)
        if finite:
            clip = self.config.optimizer.grad_clip
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0  # as clip_grad_norm_
            s.scale_grads(coef / scale)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            s.attach_grads()
            self.optimizer.step()
            s.detach_grads()
            s.after_step()
        s.zero_grad()
        self.global_step += 1
        self.last_traffic = self.comm.counter.snapshot()
        self.last_traffic_bytes = self.comm.counter.total()
        self.comm.counter.reset()
        return StepInfo(self.global_step, lr, grad_norm, not finite, scale, self.scaler.skipped)

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> dict[str, Any]:
        """Model-state bytes measured from the tensors this rank holds, plus process peaks."""
        from zerotrain.memory import measured_process_memory

        rep: dict[str, Any] = {
            "rank": self.rank, "world_size": self.world_size, "strategy": self.strategy.name,
            "precision": self.policy.describe(),
            "model_states": self.strategy.memory_breakdown(),
            "buffer_numels": self.strategy.buffer_numels(),
        }
        rep.update(measured_process_memory(self.device))
        return rep

    def close(self) -> None:
        self.strategy.close()


def initialize(model: nn.Module, config: Config | dict | None = None,
               device: torch.device | None = None) -> Engine:
    """Open the process group if torchrun started us, then build the Engine."""
    cfg = config if isinstance(config, Config) else build_config(config or {})
    if launched_by_torchrun() and not torch.distributed.is_initialized():
        init_distributed(cfg.train.device, cfg.comm.backend, cfg.comm.timeout_s)
    return Engine(model, cfg, device)
