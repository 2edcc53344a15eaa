"""`deepspeed.comm` for scripts that call it (`deepspeed.comm.get_rank()`, ...): the same
functions from torch.distributed, with the answers of a single process when no group is
open (rank 0 of 1), as DeepSpeed's own give after `init_distributed` without a launcher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zerotrain.comm.dist import local_rank
from zerotrain.deepspeed import group as ds_group

__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_initialized"]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: Any = None, init_method: Any = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Open the process group from torchrun's environment, if not open yet (a single
    process without a launcher runs alone, world size 1)."""
    if dist_init_required is False or torch.distributed.is_initialized():
        return
    if init_method is not None or rank != -1 or world_size != -1:
        raise ValueError("init_distributed(init_method=, rank=, world_size=): zerotrain opens "
                         "the group from the launcher's environment only; start the script "
                         "with torchrun (or zerotrain train --nproc)")
    seconds = int(timeout.total_seconds()) if timeout is not None else 1800
    ds_group.open_group(dist_backend or "auto", seconds)


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
