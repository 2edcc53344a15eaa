"""DeepSpeed's offload sections and `aio`, as zerotrain's tiers (ZeRO-Offload / -Infinity).

Key names and defaults are DeepSpeed 0.19.8's (runtime/zero/offload_config.py,
runtime/swap_tensor/constants.py). What each becomes:

- `offload_param.device` none|cpu|nvme -> zero.offload_param (stage 3 only: only ZeRO-3
  shards the parameters); `offload_optimizer.device` none|cpu|nvme ->
  zero.offload_optimizer (cpu from stage 2, nvme at stage 3).
- `nvme_path` of a section whose device is nvme -> zero.nvme_path (zerotrain has one
  directory for both tiers: two different paths are a problem; a path beside another
  device is ignored, as DeepSpeed ignores it).
- `pin_memory`: zerotrain pins every host buffer that feeds a GPU, always: true is
  honoured on CUDA (a CPU-only run has nothing to pin), false is ignored.
- `offload_param.buffer_count` (nvme; default 5): DeepSpeed's pool of host buffers that
  parameter partitions are read into from NVMe — the ones in use and the ones read
  ahead. zerotrain reads a unit's whole shard into one buffer, so N buffers are the unit
  in use plus N-1 ahead: zero.offload_prefetch = min(N-1, 8). With device cpu DeepSpeed
  reads no buffer_count (host memory needs no read buffers): the prefetch follows
  stage3_prefetch_bucket_size (on: 1 unit ahead, 0: none).
- `aio.block_size` (bytes) -> zero.nvme_block_mb; `aio.intra_op_parallelism` (DeepSpeed
  0.19.8's name) or `aio.thread_count` (older releases') -> zero.nvme_threads; mapped
  only when a tier is nvme (noted as ignored otherwise).
- Everything else in these sections tunes DeepSpeed's own buffers and libaio and is
  named as ignored (keys.py), except `offload_optimizer.ratio` < 1 (a part of the
  optimizer left on the device), which zerotrain cannot do.
"""

from __future__ import annotations

from typing import Any

from zerotrain.config.run import offload_allowed
from zerotrain.deepspeed_config.reader import Reader

_Z = "zero_optimization"
DEVICES = ("none", "cpu", "nvme")
DS_PARAM_BUFFERS = 5  # offload_param.buffer_count default
DS_AIO_BLOCK = 1_048_576  # aio.block_size default (bytes)
DS_AIO_THREADS = 1  # aio.intra_op_parallelism default
MAX_PREFETCH = 8  # zero.offload_prefetch's upper bound


def _device(r: Reader, section: str, stage: int) -> str:
    """The device of one offload section, or "none" after noting a problem."""
    path = f"{_Z}.{section}.device"
    zfield = f"zero.{section}"
    dev = r.get(path, "none", str, auto=zfield)
    if dev not in DEVICES:
        r.problem(path, "must be none, cpu or nvme")
    elif dev == "none":
        return dev
    elif section == "offload_param" and stage != 3:
        r.problem(path, "parameters are offloaded at ZeRO stage 3 only (only it shards "
                        f"them; DeepSpeed too); set {_Z}.stage 3")
    elif dev == "nvme" and stage != 3:
        r.problem(path, f"zerotrain keeps optimizer states on NVMe at ZeRO stage 3 only; set "
                        f"{_Z}.stage 3 or device cpu")
    elif not offload_allowed(stage) and not (stage == 1 and section == "offload_optimizer"):
        r.problem(path, f"zerotrain offloads from ZeRO stage 2 or 3 (DeepSpeed also at 1); "
                        f"set {_Z}.stage 2")
    else:
        return dev
    return "none"


def _nvme_path(r: Reader, devices: dict[str, str]) -> str | None:
    paths: dict[str, str] = {}
    for section, dev in devices.items():
        path = f"{_Z}.{section}.nvme_path"
        v = r.get(path, None, str)
        if v is None:
            if dev == "nvme":
                r.problem(f"{_Z}.{section}.device", f"device nvme needs {path} (a directory "
                                                    "on a fast local disk)")
        elif dev == "nvme":
            paths[path] = v
        else:
            r.notes.append(f"{path}: ignored ({section}.device is {dev}; DeepSpeed reads "
                           "it with nvme only)")
    if len(set(paths.values())) > 1:
        (a, va), (b, vb) = paths.items()
        r.problems.append(f'{a}="{va}" and {b}="{vb}": zerotrain keeps both nvme tiers under '
                          "one directory (zero.nvme_path); give the same path")
    return next(iter(paths.values()), None)


def _pin(r: Reader, section: str, dev: str) -> None:
    path = f"{_Z}.{section}.pin_memory"
    pin = r.get(path, None, bool)
    if pin is None:
        return
    if dev == "none":
        r.notes.append(f"{path}: ignored ({section}.device is none)")
    elif pin:
        r.notes.append(f"{path}: honoured (zerotrain pins the host buffers that feed a GPU "
                       "on CUDA; a CPU-only run has nothing to pin)")
    else:
        r.notes.append(f"{path}: ignored (zerotrain pins the host buffers that feed a GPU "
                       "on CUDA always)")


def _prefetch(r: Reader, dev: str, prefetch: bool) -> int | None:
    """zero.offload_prefetch from offload_param (see the module's docstring)."""
    path = f"{_Z}.offload_param.buffer_count"
    if dev != "nvme":
        if r.raw(path, None) is not None:
            r.notes.append(f"{path}: ignored (DeepSpeed reads it with device nvme only)")
        return None if dev == "none" or prefetch else 0
    n = r.get(path, DS_PARAM_BUFFERS, int)
    if n < 0:
        r.problem(path, "must be >= 0")
        return None
    ahead = min(max(n - 1, 0), MAX_PREFETCH)
    r.notes.append(f"{path}: {n} -> zero.offload_prefetch {ahead} (a unit's shard takes one "
                   f"buffer: the unit in use + {ahead} read ahead"
                   + (f", at most {MAX_PREFETCH}" if n - 1 > MAX_PREFETCH else "") + ")")
    return ahead


def _aio(r: Reader, nvme: bool, zero: dict[str, Any]) -> None:
    mapped = ("aio.block_size", "aio.intra_op_parallelism", "aio.thread_count")
    if not nvme:
        for path in mapped:
            if r.raw(path, None) is not None:
                r.notes.append(f"{path}: ignored (no nvme tier in this config)")
        return
    block = r.get("aio.block_size", DS_AIO_BLOCK, int)
    if block < 1:
        r.problem("aio.block_size", "must be >= 1 byte")
    else:
        zero["nvme_block_mb"] = block / 2**20
    threads = {p: r.get(p, None, int) for p in mapped[1:]}
    given = {p: v for p, v in threads.items() if v is not None}
    if len(set(given.values())) > 1:
        r.problems.append("aio.intra_op_parallelism and aio.thread_count (its older name) "
                          "differ; give one")
        return
    n = next(iter(given.values()), DS_AIO_THREADS)
    if n < 1:
        r.problem(next(iter(given)), "must be >= 1")
    else:
        zero["nvme_threads"] = n


def offload(r: Reader, stage: int, zero: dict[str, Any]) -> None:
    """The offload sections and `aio`, into `zero` (the zerotrain zero: section)."""
    devices = {s: _device(r, s, stage) for s in ("offload_optimizer", "offload_param")}
    for section, dev in devices.items():
        if dev != "none":
            zero[section] = dev
        _pin(r, section, dev)
    path = _nvme_path(r, devices)
    if path is not None:
        zero["nvme_path"] = path
    ahead = _prefetch(r, devices["offload_param"], zero.get("prefetch", True))
    if ahead is not None:
        zero["offload_prefetch"] = ahead
    _aio(r, "nvme" in devices.values(), zero)
