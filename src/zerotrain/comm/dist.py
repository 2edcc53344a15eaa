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
    owns_group: bool = False  # True when init_distributed opened it (so train() closes it)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(kind: str = "auto", local_rank: int = 0,
                local_world: int | None = None) -> torch.device:
    """This rank's device: one GPU per local rank (never two ranks on one GPU: NCCL
    refuses that), or the CPU.

    `local_world` is given by the launcher only (`--nproc`), the one place where it is
    known that all the ranks share this process's list of GPUs. A rank itself cannot
    know that: under per-rank isolation (SLURM `--gpus-per-task=1`, Kubernetes device
    plugins, a wrapper setting CUDA_VISIBLE_DEVICES per rank) every rank sees exactly one
    GPU — its own, `cuda:0` — whatever its local rank.
    """
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ConfigError("train.device is 'cuda' but no CUDA device is visible; use "
                              "--train.device cpu")
        if local_world is not None and local_world > gpus:
            raise ConfigError(f"{local_world} local ranks but {gpus} visible GPU(s); use "
                              f"--nproc <= {gpus}, or --train.device cpu")
        if local_rank < gpus:
            return torch.device("cuda", local_rank)
        if gpus == 1:  # isolated: this rank's own GPU (NCCL names a real duplicate)
            return torch.device("cuda", 0)
        source = local_rank_source()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ConfigError(
            f"local rank {local_rank} (from {source}) but this process sees {gpus} GPUs "
            f"(CUDA_VISIBLE_DEVICES={visible}); set LOCAL_RANK to the rank's index on its "
            "node, or CUDA_VISIBLE_DEVICES to the GPUs of this node (one per local rank)")
    return torch.device("cpu")


#: where a launcher puts the rank's index on its node, most specific first; RANK (the
#: global rank) only when none is set, which is right on one node only
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "RANK")


def default_node_size(world_size: int) -> int:
    """Ranks per node: LOCAL_WORLD_SIZE (torchrun sets it), else all ranks on one node."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return n if n >= 1 and world_size % n == 0 else world_size


def local_rank_source() -> str:
    """The environment variable `local_rank()` read (or "default" when none is set)."""
    return next((v for v in LOCAL_RANK_VARS if v in os.environ), "default")


def local_rank() -> int:
    """This process's index on its node: LOCAL_RANK (torchrun), SLURM_LOCALID (srun),
    OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else RANK (a launcher that sets only that: one
    node), else 0. init_distributed and the Engine both use it, so they agree on the GPU."""
    source = local_rank_source()
    return int(os.environ[source]) if source != "default" else 0


def bind_device(kind: str = "auto") -> torch.device:
    """This rank's device, made current (`torch.cuda.set_device`).

    Also when the caller opened the process group itself: implicit-device calls (pinned
    memory, `barrier`, NCCL's own guesses) then land on this rank's GPU, not on GPU 0.
    """
    dev = pick_device(kind, local_rank())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def pick_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("comm.backend 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on "
                          "CPU")
    if requested == "gloo" and device.type == "cuda":
        # gloo's CUDA support differs by version and by operation (some collectives stage
        # through the host, some are missing): a run would test gloo, not this code
        raise ConfigError("comm.backend 'gloo' with CUDA devices is not supported: gloo's "
                          "CUDA collectives vary by torch version and operation and are no "
                          "stand-in for NCCL; use comm.backend nccl (or auto) on GPUs, or "
                          "--train.device cpu to run gloo on the CPU")
    return requested


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors for `group` must live: the CPU when the group has a CPU backend
    (gloo, or "cpu:gloo,cuda:nccl"), else the current GPU.

    NCCL registers itself for `cuda` only, so a CPU tensor handed to an NCCL group fails
    with "No backend type associated with device type cpu": control reductions (loss,
    norms, flags) must be moved here first.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    kinds = [part.split(":")[0] for part in dist.get_backend_config(group).split(",")]
    if "cpu" in kinds:
        return torch.device("cpu")
    if kinds[0] == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kinds[0])


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: int = 120
) -> DistInfo:
    """Open the default process group when launched by torchrun; otherwise world size 1."""
    global _STORE
    if not launched_by_torchrun():
        return DistInfo(0, 1, 0, bind_device(device), None)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dev = bind_device(device)
    be = pick_backend(backend, dev)
    opened = not dist.is_initialized()
    if opened:
        timeout = datetime.timedelta(seconds=timeout_s)
        _STORE = _attempt_store(rank, world, timeout)
        dist.init_process_group(be, timeout=timeout, store=_STORE, rank=rank, world_size=world,
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, world, local_rank(), dev, be, owns_group=opened)


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


#: The rendezvous store of the group init_distributed opened (None when the caller
#: opened it): `patient_barrier` waits on it.
_STORE: dist.Store | None = None
PATIENT_TIMEOUT_S = 24 * 3600


def patient_barrier(timeout_s: float = PATIENT_TIMEOUT_S) -> None:
    """A barrier for one rank's long solo work (rank 0 tokenizing a corpus, training a
    BPE, finishing a checkpoint on a slow filesystem): it waits on the rendezvous store,
    so `comm.timeout_s` — sized for collectives, which should never wait long — does not
    cut it short. On NCCL that matters more: a collective that times out is not an error
    there but the watchdog aborting the process. When the caller opened the group, its
    default store serves (a plain barrier if even that is unavailable)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _STORE if _STORE is not None else _default_store()
    if store is None:
        dist.barrier()
        return
    # The barrier's number is counted in the store, per rank: a fresh group (a new store
    # or prefix, a restart's attempt) starts at 0 on every rank, whatever each process
    # did before (a process-wide counter drifts when ranks regroup unevenly).
    n = store.add(f"zerotrain/patient_barrier/count/{dist.get_rank()}", 1)
    key = f"zerotrain/patient_barrier/{n}"
    if store.add(key, 1) == dist.get_world_size():
        store.set(key + "/all", "1")
    store.wait([key + "/all"], datetime.timedelta(seconds=timeout_s))


def _default_store() -> dist.Store | None:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def shutdown() -> None:
    global _STORE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None
