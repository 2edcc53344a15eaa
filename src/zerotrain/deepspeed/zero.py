"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters`.

`Init`: the parameters of the model built inside the block live on the meta device
(each goes there as it is registered, so no more than one is ever allocated; buffers,
such as rotary tables, are built for real); `initialize` then lays it out and gives
each rank only its part, unit by unit, with the values of each module's
`reset_parameters()` (or the model plan's init rule). The values are drawn when the
engine lays the model out, not while it is built: the same distributions as an eager
build, other draws. Load real weights inside `GatheredParameters(...,
modifier_rank=0)`, before or after `initialize` (from_pretrained does: the engine then
reads each rank's shard from the loaded values).

`GatheredParameters(params, modifier_rank=None)`: inside the block `params` are whole on
every rank (ZeRO-3 gathers the units holding them, not the whole model; a collective,
so every rank enters it). With `modifier_rank`, that rank's values of `params` are broadcast on exit
and become the master weights every rank keeps (re-sharded); without it, edits are
discarded as in DeepSpeed where weights are partitioned. (DeepSpeed 0.19.8 itself,
after `initialize`: at ZeRO-1-3 its first step writes its fp32 masters, copied before
the edit, back over it; below ZeRO-3 nothing is broadcast, so only the modifier rank
sees the edit (at ZeRO-0 for the whole run: the ranks' weights part). zerotrain keeps
the edit on every rank: bench/ds_compat.py, case `gathered`.)

Before `initialize`, on a model built under `Init` (DeepSpeed's usual way to load
pretrained weights), the parameters are real tensors inside the block (the values
written in an earlier block where this rank holds them, else zeros: nothing is drawn
before `initialize` lays the model out); with `modifier_rank`, that rank keeps its values
aside on the host and the parameters go back to the meta device. `initialize` then hands
each rank its part (deepspeed/pending.py: one parameter broadcast at a time, each rank
keeping only its elements), so no other rank ever holds the whole model.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from zerotrain.comm.dist import comm_device
from zerotrain.deepspeed.group import open_group


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
    open_group()  # as DeepSpeed's Init does (deepspeed/group.py)
    counter = itertools.count()

    def to_meta(module: Any, name: str, param: Any) -> Any:
        """Each parameter goes to the meta device as it is registered (its host copy
        freed at once: one parameter at a time), numbered in creation order."""
        if param is None:
            return None
        if param.device.type != "meta":
            param = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype or param.dtype,
                                                   device="meta"), param.requires_grad)
        param._zt_order = next(counter)  # every rank builds the same model: the same order
        return param
    def number(module: Any, name: str, buffer: Any) -> None:
        if buffer is not None:  # buffers stay real; numbered for the broadcasts' order
            buffer._zt_order = next(counter)
    hooks = [register_module_parameter_registration_hook(to_meta),
             register_module_buffer_registration_hook(number)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _ordered(params: list[Tensor], engine: Any = None) -> list[Tensor]:
    """`params` in an order every rank agrees on (callers pass sets: transformers does),
    for the broadcasts: the engine's parameter order, else the order of creation."""
    if engine is not None:
        index = {id(p): i for i, p in enumerate(engine.module.parameters())}
        return sorted(params, key=lambda p: index.get(id(p), -1))
    return sorted(params, key=lambda p: getattr(p, "_zt_order", -1))


#: DeepSpeed's Init wraps torch's tensor constructors and transformers swaps that wrapper
#: around it (`prevent_arange_dtype_change`); zerotrain's Init builds on the meta device
#: and wraps nothing, so the hook is the identity
_orig_torch_arange = torch.arange


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ZeRO-3 parameter states (zerotrain's parameters are whole inside the
    forward and inside `GatheredParameters`)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: Any = None,
                                           target_device: Any = None) -> Any:
    return fn


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
    """`src`'s values on every rank, through the device the group's backend takes: NCCL
    has no CPU backend, and the parameters of a model built under `Init` are host
    tensors before `initialize` ("No backend type associated with device type cpu")."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    dev = comm_device()
    with torch.no_grad():
        for p in params:
            if p.device == dev:
                dist.broadcast(p.data, src=src)
                continue
            t = p.data.to(dev)
            dist.broadcast(t, src=src)
            p.data.copy_(t)


#: id(parameter) -> (parameter, values written before initialize or None where another
#: rank holds them, the rank that does); initialize takes them
_PENDING: dict[int, tuple[Tensor, Tensor | None, int]] = {}


def take_pending(module: torch.nn.Module) -> dict[str, tuple[Tensor | None, int]]:
    """Values written into `module`'s meta parameters before initialize, by name: (the
    values, or None where rank `src` alone holds them; src)."""
    out = {}
    for name, p in module.named_parameters():
        if id(p) in _PENDING and _PENDING[id(p)][0] is p:
            _, value, src = _PENDING.pop(id(p))
            out[name] = (value, src)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _swap(p: Tensor, data: Tensor) -> Tensor:
    """Give `p` other storage in place, keeping its Python attributes (transformers marks
    loaded weights with `_is_hf_initialized`) and its class; returns the tensor that now
    holds p's former storage."""
    attrs = dict(p.__dict__)
    new = (torch.nn.Parameter(data, p.requires_grad) if isinstance(p, torch.nn.Parameter)
           else data)
    torch.utils.swap_tensors(p, new)
    p.__dict__.update(attrs)
    return new


@contextmanager
def _on_host(params: list[Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Meta parameters made real for the block (the values written in an earlier block
    where this rank holds them, else zeros); on exit the modifier rank keeps its values
    aside (the block's own storage: no copy), the other ranks only note who holds them:
    `initialize` hands each rank its shard, so no rank but the loading one holds the
    whole model (from_pretrained)."""
    meta = [p for p in params if p.device.type == "meta"]
    for p in meta:
        held = _PENDING.get(id(p))
        start = held[1] if held is not None and held[0] is p else None
        if start is None:
            start = torch.zeros(p.shape, dtype=p.dtype)
        elif modifier_rank is None:  # a read-only block leaves the held values as they were
            start = start.clone()
        _swap(p, start)
    kept = False
    try:
        yield
        if modifier_rank is not None:
            _broadcast([p for p in params if p.device.type != "meta"
                        and not any(p is m for m in meta)], modifier_rank)
            kept = True
    finally:
        mine = _rank() == modifier_rank
        for p in meta:
            old = _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
            if kept:
                _PENDING[id(p)] = (p, old.detach() if mine else None, modifier_rank)


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
    plist = _ordered(plist, engine)
    if engine is None:  # before initialize: the parameters are the module's own
        with _on_host(plist, modifier_rank):
            yield
        return
    with engine.full_parameters(plist):  # only the units holding `params` (as DeepSpeed)
        yield
        if modifier_rank is not None:
            _broadcast(plist, modifier_rank)
            engine.write_weights({}, plist)
