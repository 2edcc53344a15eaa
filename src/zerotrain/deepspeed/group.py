"""Opening the process group for a DeepSpeed script, in one place: `deepspeed.comm.
init_distributed` and `deepspeed.zero.Init` (DeepSpeed's own opens the group when none is
open; a script that relies on it would otherwise have none, and `GatheredParameters`
would broadcast nothing: every rank would keep its own values). `OPENED` says whether
zerotrain.deepspeed opened it, so the exit hook closes it (deepspeed/engine.py)."""

from __future__ import annotations

import os

import torch.distributed as dist

from zerotrain.comm.dist import init_distributed, launched_by_torchrun

#: whether zerotrain.deepspeed opened the process group (and so closes it at exit)
OPENED = False


def open_group(backend: str = "auto", seconds: int = 1800) -> None:
    """Open the group from torchrun's environment if none is open (a process without a
    launcher runs alone)."""
    global OPENED
    if dist.is_initialized() or not launched_by_torchrun():
        return
    if os.environ.get("ZEROTRAIN_LAUNCHER_PID"):  # started by `zerotrain launch`
        from zerotrain.comm.launch import quiet_when_peer_gone
        from zerotrain.run.lifecycle import die_with_parent

        die_with_parent()
        quiet_when_peer_gone()  # a peer's death: the launcher's line, not a traceback
    OPENED = init_distributed("auto", backend, seconds).owns_group
