"""Process-group lifecycle: who am I, how many are we, which backend and device.

Ranks are started by torchrun (or `zerotrain train --nproc N`, which wraps it); this
module only reads the environment torchrun sets and opens the default group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerotrain.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single process without a group


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(kind: str = "auto", local_rank: int = 0,
                local_world: int | None = None) -> torch.device:
    """This rank's device: one GPU per local rank (never two ranks on one GPU: NCCL
    refuses that), or the CPU."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ConfigError("train.device is 'cuda' but no CUDA device is visible; use "
                              "--train.device cpu")
        local = local_world if local_world is not None else int(
            os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local > gpus:
            raise ConfigError(f"{local} local ranks but {gpus} visible GPU(s); use --nproc "
                              f"<= {gpus}, or --train.device cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("comm.backend 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on "
                          "CPU")
    return requested


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: int = 600
) -> DistInfo:
    """Open the default process group when launched by torchrun; otherwise world size 1."""
    if not launched_by_torchrun():
        return DistInfo(0, 1, 0, pick_device(device), None)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = pick_device(device, local_rank)
    be = pick_backend(backend, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(be, timeout=timeout, store=_attempt_store(rank, world, timeout),
                                rank=rank, world_size=world,
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, world, local_rank, dev, be)


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this attempt of the job.

    After a restart (`--max-restarts`), torchrun's agent keeps its store: without a
    per-attempt prefix the new ranks can read the dead ranks' connection addresses and
    never connect.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"zerotrain/attempt_{attempt}", store)


def world() -> tuple[int, int]:
    """(rank, world_size), (0, 1) when no group is open."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
