"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters`.

`Init`: the model built inside the block lives on the meta device (no weights are
allocated); `initialize` then lays it out and gives each rank only its part, unit by
unit, with the values of each module's `reset_parameters()` (or the model plan's init
rule). The values are drawn when the engine lays the model out, not while it is built:
the same distributions as an eager build, other draws. Load real weights inside
`GatheredParameters(..., modifier_rank=0)`, before or after `initialize`.

`GatheredParameters(params, modifier_rank=None)`: inside the block every parameter of
the engine's model is whole on every rank (ZeRO-3 gathers; a collective, so every rank
enters it). With `modifier_rank`, that rank's values of `params` are broadcast on exit
and become the master weights every rank keeps (re-sharded); without it, edits are
discarded as in DeepSpeed where weights are partitioned. (DeepSpeed 0.19.8 itself,
after `initialize`: at ZeRO-1-3 its first step writes its fp32 masters, copied before
the edit, back over it; below ZeRO-3 nothing is broadcast, so only the modifier rank
sees the edit (at ZeRO-0 for the whole run: the ranks' weights part). zerotrain keeps
the edit on every rank: bench/ds_compat.py, case `gathered`.)

Before `initialize`, on a model built under `Init` (DeepSpeed's usual way to load
pretrained weights), the parameters are real tensors inside the block (zeros: nothing
is drawn before `initialize` lays the model out); with `modifier_rank`, that rank's
values are broadcast on exit and kept aside (on the host) until `initialize`, which
writes them over the initial values; the parameters go back to the meta device.
"""

from __future__ import annotations

import weakref
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


#: live engines (zerotrain.deepspeed.engine registers each), so GatheredParameters can
#: find the engine that owns a parameter
ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()

def _as_list(params: Any) -> list[Tensor]:
    if params is None:
        return []
    if isinstance(params, Tensor):
        return [params]
    return list(params) if isinstance(params, Iterable) else [params]


def _owner(params: list[Tensor]) -> Any:
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


#: id(parameter) -> (parameter, values written before initialize); initialize takes them
_PENDING: dict[int, tuple[Tensor, Tensor]] = {}


def take_pending(module: torch.nn.Module) -> dict[str, Tensor]:
    """Values written into `module`'s meta parameters before initialize, by name."""
    out = {}
    for name, p in module.named_parameters():
        if id(p) in _PENDING and _PENDING[id(p)][0] is p:
            out[name] = _PENDING.pop(id(p))[1]
    return out


@contextmanager
def _on_host(params: list[Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Meta parameters made real (zeros) for the block, kept aside on exit."""
    meta = [p for p in params if p.device.type == "meta"]
    for p in meta:
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype),
                                                       p.requires_grad))
    try:
        yield
        if modifier_rank is not None:
            _broadcast(params, modifier_rank)
            for p in meta:
                _PENDING[id(p)] = (p, p.detach().clone())
    finally:
        for p in meta:
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(
                p.shape, dtype=p.dtype, device="meta"), p.requires_grad))


@contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None,
                       fwd_module: Any = None, enabled: bool = True) -> Iterator[None]:
    """The parameters whole inside the block (see the module docstring)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if modifier_rank is not None and not 0 <= modifier_rank < world:
        raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): the job has "
                         f"{world} rank(s), 0 to {world - 1}; name one of them (or None: "
                         "read only)")
    plist = _as_list(params)
    if not enabled or not plist:
        yield
        return
    engine = _owner(plist)
    if engine is None:  # before initialize: the parameters are the module's own
        with _on_host(plist, modifier_rank):
            yield
        return
    with engine.full_parameters():
        yield
        if modifier_rank is not None:
            _broadcast(plist, modifier_rank)
            engine.write_weights({})
