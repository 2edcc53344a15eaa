"""Optimizers: update rules on flat fp32 tensors, torch.optim-style classes, lr schedules.

- `functional`: the update rules (`adamw_`, `sgd_`, ...), the only place their math lives;
  `batching`: how their work is cut into calls (cache blocks, device chunks, compile).
- `optimizers`: torch.optim-compatible classes calling them (state names as torch's).
- `schedule`: warmup / hold / decay learning rate as a pure function of the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.numerics.blockquant import BLOCK
from zerotrain.numerics.compact import FP32, Compact
from zerotrain.optim import functional
from zerotrain.optim.muon import Muon
from zerotrain.optim.optimizers import SGD, Adagrad, Adam, AdamW, Lion, RMSprop
from zerotrain.optim.schedule import WarmupDecayLR, lr_at, lr_from_config

if TYPE_CHECKING:
    from zerotrain.config import OptimizerConfig

__all__ = [
    "OPTIMIZERS", "SGD", "Adagrad", "Adam", "AdamW", "Lion", "Muon", "RMSprop",
    "WarmupDecayLR", "build_optimizer", "functional", "is_elementwise", "lr_at",
    "lr_from_config", "resolve_compile",
    "state_bytes_per_param",
]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": AdamW,
    "adam": Adam,
    "sgd": SGD,
    "adagrad": Adagrad,
    "rmsprop": RMSprop,
    "lion": Lion,
    "muon": Muon,
}

MUON_DEFAULT_MOMENTUM = 0.95
#: `optimizer.compile: auto` compiles Adam/AdamW from this many parameters per rank on:
#: there the eager update costs ~40 ms more per step than the fused one (bench/optim.py),
#: which repays seconds of compilation within a few hundred steps.
COMPILE_AUTO_MIN_PARAMS = 1 << 24


def _class(name: str) -> Any:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def is_elementwise(name: str) -> bool:
    """Whether the rule may run on flat runs of parameters (all but Muon)."""
    return bool(_class(name).elementwise)


def state_bytes_per_param(name: str, momentum: float = 0.0, state_dtype: str = "fp32"
                          ) -> float:
    """Optimizer-state bytes per parameter: K in the memory model (SPEC §6).

    fp32 states: adam/adamw 8 (m, v); sgd 0, or 4 with momentum; adagrad 4 (sum of g²);
    rmsprop 4 (+4 with momentum); lion 4; muon 4 (its AdamW-fallback tensors carry 8).
    `state_dtype` bf16 halves each state; int8 stores 1 byte plus a 4-byte scale per
    256 elements (1.015625) per state. The fp32 master copy of mixed precision is not
    optimizer state and is not counted here (nor is Kahan's compensation: a master's).
    """
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"unknown optimizer.state_dtype {state_dtype!r}; choose one of "
                         f"{', '.join(STATE_BYTES)}")
    k = _class(name).state_bytes_per_param(momentum=momentum) // 4 * STATE_BYTES[state_dtype]
    return int(k) if k == int(k) else k


#: bytes per element of one optimizer state in each optimizer.state_dtype
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}


def resolve_compile(setting: bool | str, param_groups: list[dict[str, Any]]) -> bool:
    """`optimizer.compile` as a bool: "auto" is True for large optimizer shards only.

    `param_groups` as an optimizer holds them (each "params" a list of tensors).
    """
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"optimizer.compile must be true, false or auto, got {setting!r}")
    numel = sum(p.numel() for g in param_groups for p in g["params"])
    return numel >= COMPILE_AUTO_MIN_PARAMS


def _set_compiled(opt: torch.optim.Optimizer, compiled: bool) -> None:
    opt.defaults["compiled"] = compiled
    for g in opt.param_groups:
        g["compiled"] = compiled


def _compile_agreed(opt: Any, wanted: bool, agree: Callable[[bool], bool]) -> bool:
    """Whether to compile, decided by all ranks together (see build_optimizer)."""
    failure = opt.compile_probe() if wanted else None
    if not agree(failure is not None):
        return wanted
    where = f"here: {failure}" if failure else "on another rank"
    warnings.warn(f"torch.compile of the optimizer step failed {where}; every rank runs the "
                  "eager update instead, so that replicas stay identical", RuntimeWarning,
                  stacklevel=4)
    return False


def build_optimizer(
    cfg: OptimizerConfig, param_groups: list[dict[str, Any]], compact: Compact | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> torch.optim.Optimizer:
    """Map the `optimizer:` config section onto the class's hyper-parameters.

    `compact`: how states are stored and bf16 masters updated (the precision policy's;
    default: optimizer.state_dtype with fp32 masters).

    Each group dict already carries its own "weight_decay" (and may carry "lr");
    cfg values are the defaults for whatever a group leaves out.

    `agree(failed) -> any rank failed` (the engine passes a MAX all-reduce when there
    are several ranks): the compiled update is then tried at the first `step()` (which
    every rank takes together), before any real update, and the ranks fall back to eager
    together if it fails on any one of them. At the first step, not here: loading the
    compiler costs ~50 MiB that init would otherwise hold before the model does.
    """
    opt = _build(cfg, param_groups, agree)
    opt.compact = compact or (Compact(cfg.state_dtype) if cfg.state_dtype != "fp32" else FP32)
    opt.compact_compiled = opt.compact.active and _compact_compile(cfg.compile, opt.param_groups)
    return opt


def _compact_compile(setting: bool | str, param_groups: list[dict[str, Any]]) -> bool:
    """`optimizer.compile` for the compact kernels (compiled and eager give the same
    bits, so ranks need not agree): only when asked (true). auto stays eager: on this
    project's CPUs the compiled kernels measured slower than the eager ones
    (docs/compact-states.md)."""
    del param_groups
    return setting is True


def _build(cfg: OptimizerConfig, param_groups: list[dict[str, Any]],
           agree: Callable[[bool], bool] | None) -> Any:
    name, lr, wd = cfg.name, cfg.lr, cfg.weight_decay
    _class(name)  # a clear error for an unknown name
    if name in ("adam", "adamw"):
        opt = _class(name)(param_groups, lr=lr, betas=cfg.betas, eps=cfg.eps,
                           weight_decay=wd, compiled=False)
        # decided on the groups as torch.optim normalised them (any iterable of params)
        compiled = resolve_compile(cfg.compile, opt.param_groups)
        _set_compiled(opt, compiled)
        if agree is not None and cfg.compile is not False:  # every rank takes part
            opt.before_first_step = lambda: _set_compiled(
                opt, _compile_agreed(opt, compiled, agree))
        return opt
    if name == "sgd":
        return SGD(param_groups, lr=lr, momentum=cfg.momentum, dampening=cfg.dampening,
                   weight_decay=wd, nesterov=bool(cfg.nesterov))
    if name == "adagrad":
        return Adagrad(param_groups, lr=lr, lr_decay=cfg.lr_decay, weight_decay=wd,
                       eps=cfg.eps)
    if name == "rmsprop":
        return RMSprop(param_groups, lr=lr, alpha=cfg.alpha, eps=cfg.eps, weight_decay=wd,
                       momentum=cfg.momentum)
    if name == "lion":
        return Lion(param_groups, lr=lr, betas=cfg.betas, weight_decay=wd)
    if name == "muon":
        return Muon(param_groups, lr=lr, weight_decay=wd,
                    momentum=cfg.momentum or MUON_DEFAULT_MOMENTUM,
                    nesterov=True if cfg.nesterov is None else cfg.nesterov,
                    ns_steps=cfg.ns_steps, adamw_betas=cfg.betas, adamw_eps=cfg.eps,
                    adjust_lr_fn=cfg.muon_adjust_lr)
    raise AssertionError(f"optimizer '{name}' is registered but not mapped from the config")
