"""The one way tests run several ranks: N spawned gloo processes on localhost.

`run_ranks(fn, n, *args)` starts n processes with the environment torchrun would set
(RANK, WORLD_SIZE, MASTER_ADDR/PORT on a free port), opens the gloo group, calls
`fn(*args)` in each and returns the per-rank results in rank order. A rank that raises
fails the call with that rank's traceback. `fn` must be importable (module level).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, q) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        dist.barrier()
        # Serialise here: tensors sent through a Queue share memory with a process that is
        # about to exit.
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank, True, buf.getvalue()))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = q.get(timeout=timeout)
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the others may now hang on a collective; stop them below
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
