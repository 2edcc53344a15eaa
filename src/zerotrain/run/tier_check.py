"""The launcher's check of ZeRO-Infinity's disk (`zero.nvme_path`) before any rank starts:
a path that cannot hold the run's files is one error line, not one traceback per rank.

The ranks check again when they cut their units (zero/states/disk.py `reserve`, the exact
bytes), so a disk filling after this check still fails before the first step.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from zerotrain.config import Config
from zerotrain.zero.tiers.io import TierError, free_bytes


def disk_bytes_per_rank(cfg: Config, world: int, device_type: str) -> int:
    """The run's files on the disk per rank, as `zerotrain estimate` counts them (the
    shape the engine cuts, built on the meta device: no weights are made)."""
    from zerotrain.memory import shape_state_bytes
    from zerotrain.models import build_model, plan_for
    from zerotrain.zero import run_shape, strategy_class

    model = build_model(cfg.model, device="meta")
    shape = run_shape(strategy_class(cfg.zero), cfg, model, plan_for(model), device_type, world)
    return shape_state_bytes(shape).disk_total


def check_nvme_path(cfg: Config, world: int, device_type: str) -> None:
    """Refuse an nvme_path that is not a writable directory, or whose disk lacks room
    for the files of this machine's `world` ranks."""
    z = cfg.zero
    if "nvme" not in (z.offload_param, z.offload_optimizer) or not z.nvme_path:
        return
    path = Path(z.nvme_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zerotrain-probe-"):
            pass
    except OSError as e:
        why = "it is a file, not a directory" if path.is_file() else e.strerror or str(e)
        raise TierError(
            f"zero.nvme_path {z.nvme_path}: cannot create the run's offload files "
            f"there ({why}): give a writable directory on a local disk"
        ) from None
    need = disk_bytes_per_rank(cfg, world, device_type) * world
    free = free_bytes(os.fspath(path))
    if free < need:
        raise TierError(
            f"zero.nvme_path {z.nvme_path}: the {world} rank(s)' offload files need about "
            f"{need} bytes ({need / 2**20:.1f} MiB) and only {free} bytes "
            f"({free / 2**20:.1f} MiB) are free there: free space, or point zero.nvme_path "
            "at a larger disk"
        )
