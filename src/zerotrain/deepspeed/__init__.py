"""DeepSpeed's script surface over zerotrain: change one import line and keep the script.

    import zerotrain.deepspeed as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=dataset)
    for x, y in loader:
        loss = criterion(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()

A thin translation onto zerotrain's Engine (`zerotrain.initialize` stays as it is):
the DeepSpeed config is mapped by `zerotrain.deepspeed_config` (every key zerotrain
cannot honour is refused by name); the optimizer, scheduler and checkpoint semantics
that a script sees are DeepSpeed's (`engine.py`, `optim.py`). What matches and what
differs is listed in docs/from-deepspeed.md.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from zerotrain.comm.dist import world
from zerotrain.deepspeed import accelerator, comm, zero
from zerotrain.deepspeed.comm import init_distributed
from zerotrain.deepspeed.engine import DeepSpeedEngine
from zerotrain.deepspeed_config import load_deepspeed_config, looks_like_deepspeed, read_deepspeed

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "comm",
           "init_distributed", "initialize", "zero"]

__version__ = "0.19.8"  # the DeepSpeed release whose behaviour this layer follows

#: checkpoints saved through this layer are never pruned (DeepSpeed keeps every tag)
_KEEP_ALL = 10**9


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's --deepspeed and --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config) to `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; no effect here)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's rule: `config`, else `config_params`; args.deepspeed_config is the
    alternative to both, and giving it with one of them is an error."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None:
        from_args = getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("Not sure how to proceed, we were given deepspeed configs in the "
                             "deepspeed arguments and deepspeed.initialize() function call: "
                             "pass the config one way only")
        config = from_args
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file "
                         "(or initialize(config=...))")
    return config


def _refuse(mpu: Any, model: Any, mesh_param: Any) -> None:
    if mpu is not None:
        raise ValueError("initialize(mpu=...): zerotrain has data parallelism only (no tensor "
                         "or pipeline model parallelism); drop mpu")
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...): zerotrain has no sequence or tensor "
                         "parallel mesh; drop mesh_param")
    kind = type(model).__name__
    if kind in ("PipelineModule", "DualPipeVModule"):
        raise ValueError(f"{kind}: zerotrain has no pipeline parallelism; pass the plain "
                         "nn.Module")
    if any(type(m).__name__ == "MoE" for m in model.modules()):
        raise ValueError("DeepSpeed MoE layers are not supported by zerotrain")


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    `optimizer` is the object holding the param groups (a client optimizer's groups, or
    those built from the config's `optimizer` block over `model_parameters`): schedulers
    write into it and the engine reads it before each update. None entries as DeepSpeed
    returns them: no training_data, no scheduler.
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    _refuse(mpu, model, mesh_param)
    ds, label = read_deepspeed(_config_source(args, config, config_params))
    if ds and not looks_like_deepspeed(ds):
        raise ValueError("zerotrain.deepspeed.initialize takes a DeepSpeed config; for a "
                         "zerotrain config use zerotrain.initialize(model, config)")
    init_distributed(dist_init_required=dist_init_required)
    overrides: dict[str, Any] = {"checkpoint": {"keep": _KEEP_ALL}}
    if optimizer is None and "optimizer" not in ds:  # DeepSpeed's ZeRO inference
        from zerotrain.comm.dist import bind_device
        from zerotrain.deepspeed.inference import InferenceEngine

        return InferenceEngine(model, ds, bind_device()), None, None, None
    if optimizer is not None and "optimizer" in ds:
        if world()[0] == 0:
            print("[zerotrain.deepspeed] the config's `optimizer` block is not used: the "
                  "client optimizer is, as in DeepSpeed", flush=True)
        ds = {k: v for k, v in ds.items() if k != "optimizer"}
    cfg = load_deepspeed_config(ds, world()[1], overrides, label)
    engine = DeepSpeedEngine(model, cfg, ds, optimizer, model_parameters, lr_scheduler,
                             collate_fn)
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data)
        engine.training_dataloader = loader
    return engine, engine.param_source, loader, engine.lr_scheduler
