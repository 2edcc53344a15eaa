"""zerotrain: a legible LLM training framework (optimizers, formats, mixed precision, ZeRO)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "initialize"]


def initialize(model: Any, config: Any = None, device: Any = None, *,
               overrides: dict | list | None = None) -> Any:
    """Open the process group if torchrun started us, then build the Engine.

    `config`: a Config, a dict or YAML/JSON file of zerotrain's sections, or a DeepSpeed
    config (dict or JSON file; told apart by its keys). A zerotrain config that sets no
    schedule trains at a constant lr (the library defaults), as DeepSpeed users expect.
    Imports are deferred, so `import zerotrain` stays light.
    """
    import torch

    from zerotrain.comm.dist import init_distributed, launched_by_torchrun
    from zerotrain.deepspeed_config import load_any_config
    from zerotrain.engine import Engine
    from zerotrain.optim.schedule import describe, schedule_kwargs

    cfg = load_any_config(config, overrides=overrides, library=True)
    if launched_by_torchrun() and not torch.distributed.is_initialized():
        init_distributed(cfg.train.device, cfg.comm.backend, cfg.comm.timeout_s)
    engine = Engine(model, cfg, device)
    for line in engine.strategy.describe() if engine.rank == 0 else []:
        print(f"[zerotrain] {line}", flush=True)
    sched = cfg.schedule
    if engine.rank == 0 and (sched.kind != "constant" or sched.warmup_steps):
        lr = describe(cfg.optimizer.lr, cfg.train.steps, **schedule_kwargs(sched))
        print(f"[zerotrain] {lr}", flush=True)
    return engine
