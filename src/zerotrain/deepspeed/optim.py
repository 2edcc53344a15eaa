"""The optimizer side of `zerotrain.deepspeed.initialize`: param groups, client optimizers,
and DeepSpeed's learning-rate schedulers applied in DeepSpeed's order.

The user's groups live in a `ParamGroups` object: a `torch.optim.Optimizer` over the
model's own parameters that never steps. It is what `initialize` returns as the
optimizer, what a client `lr_scheduler` (object or callable) writes into, and where the
engine reads each group's hyper-parameters before every update (`DeepSpeedEngine.apply_lr`):
zerotrain's sharded optimizer runs over flat master shards, one optimizer group per user
group (`group_id` = the user group's index), at every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zerotrain.config import Config
from zerotrain.optim.schedule import lr_from_config

#: the hyper-parameters each zerotrain optimizer reads from a group (in torch's names)
HYPER: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
    "lion": ("lr", "betas", "weight_decay"),
    "muon": ("lr", "weight_decay"),  # per group; the rest is the config's, for all groups
}

#: torch.optim class -> (zerotrain optimizer, group flags that must keep this value)
_CLIENT: dict[type, tuple[str, dict[str, Any]]] = {
    torch.optim.Adam: ("adam", {"amsgrad": False, "maximize": False, "differentiable": False}),
    torch.optim.AdamW: ("adamw", {"amsgrad": False, "maximize": False,
                                  "differentiable": False}),
    torch.optim.SGD: ("sgd", {"maximize": False, "differentiable": False}),
    torch.optim.Adagrad: ("adagrad", {"maximize": False, "differentiable": False}),
    torch.optim.RMSprop: ("rmsprop", {"maximize": False, "differentiable": False}),
}


class ParamGroups(torch.optim.Optimizer):
    """The user's param groups and their hyper-parameters; the engine does the updates.

    Built over a client optimizer's own group dicts (shared, not copied), so a scheduler
    bound to the client optimizer steers the engine as it would steer DeepSpeed's.
    """

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]):
        super().__init__(groups, defaults)
        #: whether the last update was skipped (Accelerate's `step_was_skipped` reads it)
        self.overflow = False

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        raise RuntimeError("the optimizer returned by zerotrain.deepspeed.initialize does not "
                           "step on its own: call engine.step() (it updates the sharded "
                           "optimizer and steps the lr scheduler, as DeepSpeed's does)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears gradients after each update (as DeepSpeed's does)."""


def client_optimizer_name(opt: torch.optim.Optimizer) -> str:
    """zerotrain's optimizer for a client torch.optim optimizer; one error for any other."""
    kind = _CLIENT.get(type(opt))
    if kind is None:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in _CLIENT)
        cls = type(opt)
        where = ("torch.optim" if getattr(torch.optim, cls.__name__, None) is cls
                 else cls.__module__)
        raise ValueError(f"client optimizer {where}.{cls.__qualname__}: "
                         f"zerotrain.deepspeed runs {names} (their groups and hyper-parameters "
                         "exactly); pass one of those, or name the optimizer in the config's "
                         "`optimizer` block")
    name, fixed = kind
    if any(st and float(st.get("step", 1)) > 0 for st in opt.state.values()):  # Adagrad: step 0
        raise ValueError(f"client optimizer {type(opt).__name__} has already stepped: its state "
                         "(moments, steps) would not carry over to zerotrain's sharded "
                         "optimizer; pass a fresh optimizer and restore state with "
                         "engine.load_checkpoint")
    for i, g in enumerate(opt.param_groups):
        for flag, want in fixed.items():
            if bool(g.get(flag, want)) != want:
                raise ValueError(f"client optimizer {type(opt).__name__}: param group {i} sets "
                                 f"{flag}={g[flag]}, which zerotrain's {name} does not "
                                 "implement; leave it at its default")
    if name == "adam" and any(g.get("decoupled_weight_decay") for g in opt.param_groups):
        if not all(g.get("decoupled_weight_decay") for g in opt.param_groups):
            raise ValueError("client optimizer Adam: decoupled_weight_decay differs between "
                             "param groups; zerotrain runs one rule for all groups")
        name = "adamw"  # torch's Adam(decoupled_weight_decay=True) is AdamW
    return name


def user_groups(model: torch.nn.Module, model_parameters: Any) -> list[dict[str, Any]]:
    """model_parameters as DeepSpeed takes it: None (the model's parameters), an iterable
    of tensors (one group), or of param-group dicts."""
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if items and all(isinstance(x, dict) for x in items):
        return [dict(g, params=list(g["params"]) if not isinstance(g["params"], Tensor)
                     else [g["params"]]) for g in items]
    if all(isinstance(x, Tensor) for x in items):
        return [{"params": items}]
    raise ValueError("model_parameters must be an iterable of parameters or of param-group "
                     "dicts ({'params': [...], 'weight_decay': ...}), not a mix")


def group_index(model: torch.nn.Module, groups: list[dict[str, Any]]) -> dict[str, int]:
    """Parameter name -> index of its group; every trainable parameter must be in one."""
    where = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    out, left = {}, []
    for name, p in model.named_parameters():
        if id(p) in where:
            out[name] = where[id(p)]
        elif p.requires_grad:
            left.append(name)
    if left:
        raise ValueError(f"{len(left)} trainable parameter(s) are in no optimizer group "
                         f"(first: '{left[0]}'): DeepSpeed would never update them; give "
                         "them to the optimizer, or set requires_grad=False on them")
    return out


def hyper_of(group: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The group's hyper-parameters zerotrain reads, as plain Python values."""
    out = {}
    for k in keys:
        v = group[k]
        out[k] = float(v) if isinstance(v, Tensor) else tuple(v) if isinstance(v, list) else v
    return out


# --------------------------------------------------------------------------- schedulers
@dataclass
class _Peak:
    """How DeepSpeed's scheduler finds each group's peak: one given value for all groups,
    or the group's own lr at construction."""

    shared: float | None


class ConfigScheduler:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, as DeepSpeed steps them.

    Values come from zerotrain's schedule (`lr_from_config`, equal to DeepSpeed's at every
    `last_batch_iteration`); what this adds is DeepSpeed's *sequence*: at construction the
    groups are set to warmup_min_lr (WarmupLR, WarmupDecayLR) or 0 (WarmupCosineLR,
    whose get_lr() is 0 before it has started), and the engine calls step() after each
    applied update, so update 1 runs at that initial lr, update 2 at the value at 0 and
    update k at the value at k−2. Each group has its own peak where DeepSpeed gives it
    one (WarmupLR without warmup_max_lr: the group's lr; WarmupCosineLR: the group's lr).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config, kind: str,
                 peak: _Peak):
        self.optimizer, self.cfg, self.kind = optimizer, cfg, kind
        lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.peaks = [peak.shared if peak.shared is not None else lr for lr in lrs]
        self.last_batch_iteration = -1
        self._last_lr = self._write(self.get_lr())

    def _value(self, s: int, peak: float) -> float:
        sched, opt_lr = self.cfg.schedule, self.cfg.optimizer.lr
        if self.kind == "WarmupCosineLR":  # ratios of each group's own lr
            r = peak / opt_lr if opt_lr else 0.0
            sched = sched.model_copy(update={"warmup_start_lr": sched.warmup_start_lr * r,
                                             "min_lr": sched.min_lr * r})
        return lr_from_config(s, sched, peak, self.cfg.train.steps)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            start = 0.0 if self.kind == "WarmupCosineLR" else self.cfg.schedule.warmup_start_lr
            return [start] * len(self.peaks)
        return [self._value(self.last_batch_iteration, p) for p in self.peaks]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def _write(self, lrs: list[float]) -> list[float]:
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration
                                     is None else last_batch_iteration)
        self._last_lr = self._write(self.get_lr())

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])


def config_scheduler(optimizer: torch.optim.Optimizer, cfg: Config,
                     ds: dict[str, Any]) -> ConfigScheduler | None:
    """The scheduler a DeepSpeed config's `scheduler` block builds, or None."""
    block = ds.get("scheduler")
    if not block:
        return None
    kind, params = block.get("type"), block.get("params", {}) or {}
    given = "warmup_max_lr" in params or kind == "WarmupDecayLR"  # its default is 0.001
    shared = cfg.optimizer.lr if given and kind != "WarmupCosineLR" else None
    return ConfigScheduler(optimizer, cfg, kind, _Peak(shared))
