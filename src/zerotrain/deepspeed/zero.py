"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters`.

`Init`: the model built inside the block lives on the meta device (no weights are
allocated); `initialize` then lays it out and gives each rank only its part, unit by
unit, with the values of each module's `reset_parameters()` (or the model plan's init
rule). The values are drawn when the engine lays the model out, not while it is built:
the same distributions as an eager build, other draws. Load real weights inside
`GatheredParameters(..., modifier_rank=0)` after `initialize`.

`GatheredParameters(params, modifier_rank=None)`: inside the block every parameter of
the engine's model is whole on every rank (ZeRO-3 gathers; a collective, so every rank
enters it). With `modifier_rank`, that rank's values of `params` are broadcast on exit
and become the master weights every rank keeps (re-sharded); without it, edits are
discarded as in DeepSpeed where weights are partitioned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@contextmanager
def Init(module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
         remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
         config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None,
         **_: Any) -> Iterator[None]:
    """Build the model inside on the meta device (see the module docstring)."""
    if module is not None:
        raise ValueError("zero.Init(module=...) (partitioning a model already built) is not "
                         "supported: build the model inside `with zero.Init():`")
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


def _as_list(params: Any) -> list[Tensor]:
    if params is None:
        return []
    if isinstance(params, Tensor):
        return [params]
    return list(params) if isinstance(params, Iterable) else [params]


def _owner(params: list[Tensor]) -> Any:
    from zerotrain.deepspeed.engine import ENGINES

    ids = {id(p) for p in params}
    for engine in list(ENGINES):
        if any(id(p) in ids for p in engine.module.parameters()):
            return engine
    return None


def _broadcast(params: list[Tensor], src: int) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=src)


@contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None,
                       fwd_module: Any = None, enabled: bool = True) -> Iterator[None]:
    """The parameters whole inside the block (see the module docstring)."""
    plist = _as_list(params)
    if not enabled or not plist:
        yield
        return
    engine = _owner(plist)
    if engine is None:  # before initialize: the parameters are the module's own
        if any(p.device.type == "meta" for p in plist):
            raise ValueError("GatheredParameters on a model built under zero.Init before "
                             "deepspeed.initialize: zerotrain allocates its weights when "
                             "initialize lays it out; enter the block after initialize")
        yield
        if modifier_rank is not None:
            _broadcast(plist, modifier_rank)
        return
    with engine.full_parameters():
        yield
        if modifier_rank is not None:
            _broadcast(plist, modifier_rank)
            full = {n: p for n, p in engine.module.named_parameters()}

            def read(name: str, start: int, stop: int) -> Tensor:
                return full[name].detach().reshape(-1)[start:stop]
            engine.strategy.load_weights(read)
