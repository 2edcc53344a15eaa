"""Weights written under `zero.GatheredParameters(modifier_rank=r)` before `initialize`
(transformers' `from_pretrained` under ZeRO-3): rank r alone holds them; `hand_out` gives
every rank its part once the engine has laid the model out.

Each rank first asks the strategy which elements of which parameter it keeps (a dry
`load_weights`), then the parameters are broadcast one at a time, in the model's order,
and each rank keeps only those elements: the host memory a rank needs is one parameter
plus its own part, not the model (the loading rank holds what it loaded, as it did).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zerotrain.comm.dist import comm_device


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def hand_out(engine: Any, pending: dict[str, tuple[Tensor | None, int]], whole: bool) -> None:
    """Make the engine's weights the pending values (by name) on every rank."""
    params = dict(engine.module.named_parameters())
    if not whole:  # some parameters keep their initial values: the old, whole-model path
        values = {n: _broadcast_one(v, src, params[n]) for n, (v, src) in pending.items()}
        with engine.full_parameters():
            engine.write_weights(values)
        return
    wanted: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def record(name: str, start: int, stop: int) -> Tensor:
        wanted[name].append((start, stop))
        return torch.zeros(stop - start)

    engine.strategy.load_weights(record)  # which elements this rank keeps
    kept: dict[tuple[str, int, int], Tensor] = {}
    for name, p in params.items():  # the same order on every rank
        value, src = pending.pop(name)
        flat = _broadcast_one(value, src, p).reshape(-1)
        for start, stop in wanted.get(name, ()):
            kept[(name, start, stop)] = flat[start:stop].clone()
        del value, flat
    engine.strategy.load_weights(lambda n, a, b: kept[(n, a, b)])


def _broadcast_one(value: Tensor | None, src: int, like: Tensor) -> Tensor:
    """`value` (held by rank `src`) on every rank, as fp32: exact for any loaded dtype,
    and the same size on every rank even where the module was cast since (a bf16 run).
    Sent from the device the group's backend takes (NCCL has no CPU tensors: C-1)."""
    if _world() == 1:
        assert value is not None
        return value
    dev = comm_device()
    buf = (value.float().to(dev) if value is not None
           else torch.empty(like.shape, dtype=torch.float32, device=dev))
    dist.broadcast(buf, src=src)
    return buf
