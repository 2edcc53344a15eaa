"""`deepspeed.comm` for scripts that call it (`deepspeed.comm.get_rank()`, ...): the same
functions from torch.distributed, with the answers of a single process when no group is
open (rank 0 of 1), as DeepSpeed's own give after `init_distributed` without a launcher.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ReduceOp

from zerotrain.comm.dist import local_rank

__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_initialized"]


def init_distributed(*args: Any, **kwargs: Any) -> None:
    from zerotrain.deepspeed import init_distributed as init

    init(*args, **kwargs)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return local_rank()


def barrier(group: Any = None) -> None:
    if is_initialized():
        dist.barrier(group)


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op, group, async_op) if is_initialized() else None


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group, async_op) if is_initialized() else None


def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group, async_op)
    tensor_list[0].copy_(tensor)
    return None
