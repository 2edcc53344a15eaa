"""The host allocator: freed blocks of a long-sequence step go back to the OS.

On Linux torch's CPU tensors come from glibc's malloc. glibc serves a block of at least
its mmap threshold with a memory map of its own, unmapped (returned to the OS) when freed;
a smaller one comes from its heap, where a freed block stays resident until the blocks
around it are freed too. The threshold starts at 128 KiB but *rises* to the size of each
mapped block freed, up to 32 MiB — so after the first step every tensor below 32 MiB is
carved from the heap, and a step that frees and allocates many tensors of a few MiB to
tens of MiB (a long sequence: [tokens × width] activations, tiles, exchange buffers)
leaves the heap holding far more than is live. Measured (bench/longctx.py's model, HF
Llama 2 × 128, 65,536 tokens, 2 ranks, `sequence.parallel 2`: [32,768 × 128] fp32 =
16 MiB tensors): after a step the heap held 1.12 GiB of which 0.22 GiB was in use; with
`sequence.parallel 1` the same tensors are 32 MiB, mapped, and the step peaked lower
(1.33 vs 1.82 GiB resident per rank) although it holds twice the tokens. With blocks of
1 MiB and more mapped, the same SP = 2 run peaks at 1.11 GiB per rank (heap after a
step: 0.14 GiB, 0.13 GiB in use).

The cost: a fresh map is zero pages faulted in on first touch, and the heap's top is
trimmed more often, so a run of many short-lived tensors of a few MiB pays it each
step — the main job (`make train`: 4 × 192 GPT, 16 × 256 tokens per rank) ran at 6.6–7.2k
tokens/s with 1 MiB against 10.3–10.4k with glibc's default. A long-sequence step spends
its time in a few large kernels instead (SP = 2 at 16,384 tokens: step times within the
machine's noise). Hence `train.host_mmap_mb: auto` (`mmap_threshold`): 4 MiB when the run
is a long-sequence one — tiles or sequence parallelism — and glibc's default otherwise.
Not 1 MiB: ZeRO-Offload's CPU AdamW works in blocks whose fp32 temporaries are exactly
1 MiB (optim/batching.py), and at a 1 MiB threshold each became a fresh map — 16,448
page faults and 2.2-2.9x the time per optimizer step for 16 M parameters (gpu-review-3
S-1, bench/host_mmap_step.py); at 4 MiB they come from the heap, and the tensors of
16 MiB and more that fragmented the heap are still mapped.

`return_freed_blocks(mib)` fixes the threshold (glibc's `mallopt(M_MMAP_THRESHOLD)`,
which also stops it from rising) and the heap's trim threshold: blocks of `mib` MiB and
more are mapped and given back when freed. The engine calls it with
`train.host_mmap_mb` unless the user's environment already sets glibc's
`MALLOC_MMAP_THRESHOLD_` (that choice wins). Without glibc it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import weakref

import torch
from torch import Tensor

from zerotrain.config import SequenceConfig

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
MAX_MMAP_THRESHOLD_MIB = 32


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") \
        else None


#: what `auto` sets for a long-sequence run: above the CPU optimizer's 1 MiB blocks
LONG_SEQUENCE_MMAP_MIB = 4.0


def mmap_threshold(setting: float | str | None, sequence: SequenceConfig) -> float | None:
    """`train.host_mmap_mb` resolved: `auto` is 4 MiB for a long-sequence run (tiles or
    sequence parallelism), else None (glibc's default); a number is itself."""
    if setting != "auto":
        return setting if setting is None else float(setting)
    long = sequence.tile_tokens is not None or sequence.parallel > 1
    return LONG_SEQUENCE_MMAP_MIB if long else None


_fixed = False  # whether an engine in this process has fixed the thresholds


def return_freed_blocks(mib: float | None) -> bool:
    """Blocks of at least `mib` MiB from their own memory maps, returned when freed (the
    module doc). Returns whether glibc took the setting; False when the environment sets
    `MALLOC_MMAP_THRESHOLD_`, the C library is not glibc, or `mib` is None. The setting
    is the process's: None after an earlier engine here fixed one puts glibc's risen
    thresholds back (32 MiB mapped, 64 MiB trimmed — where its own rule ends up after a
    large block is freed; the rule itself, once fixed, does not come back)."""
    global _fixed
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or (mib is None and not _fixed):
        return False
    if mib is not None and not 0 < mib <= MAX_MMAP_THRESHOLD_MIB:
        raise ValueError(f"train.host_mmap_mb must be in (0, {MAX_MMAP_THRESHOLD_MIB}] "
                         f"(glibc's limit), got {mib}; null leaves glibc's default")
    libc = _libc()
    if libc is None:
        return False
    mmap_mib, trim_mib = (MAX_MMAP_THRESHOLD_MIB, 2 * MAX_MMAP_THRESHOLD_MIB) \
        if mib is None else (mib, mib)
    # the heap's top is given back above the mapped size too (glibc's own rule keeps the
    # trim threshold at twice the mmap one)
    ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(int(mmap_mib * 2**20))) == 1 and \
        libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(int(trim_mib * 2**20))) == 1
    _fixed = mib is not None
    return ok and _fixed


def host_buffer(numel: int, dtype: torch.dtype, pinned: bool) -> Tensor:
    """Zeros in host memory; pinned at exactly this size when it feeds a GPU.

    A pinned buffer is registered for exactly as long as its memory lives: the memory is
    a ctypes array that the tensor's storage keeps alive (views included), and a
    finalizer on that array unregisters it. An Engine dropped without `close()` thus
    never leaves freed memory registered, where the next registration at the same address
    (a second Engine: tests, notebooks, sweeps) would fail with "already registered".
    """
    if not (pinned and numel):
        return torch.zeros(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    raw = (ctypes.c_uint8 * nbytes)()  # zeroed; freed with the last view of the tensor
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
    ptr = t.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        # the runtime keeps the error as its "last error" too, and the next kernel
        # launch check would report it against an unrelated op: clear it first
        clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister failed ({err}) for {numel} elements")
    _REGISTERED[ptr] = weakref.finalize(raw, _unregister, ptr)
    return t


#: data_ptr -> the finalizer that unregisters it (run early by `release_host_buffer`)
_REGISTERED: dict[int, weakref.finalize] = {}


def _unregister(ptr: int) -> None:
    _REGISTERED.pop(ptr, None)
    with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone
        torch.cuda.cudart().cudaHostUnregister(ptr)


def release_host_buffer(t: Tensor) -> None:
    """Unregister now (the memory stays valid, as pageable memory, while views live)."""
    fin = _REGISTERED.get(t.data_ptr())
    if fin is not None:
        fin()


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (torch's cudart binding has no
    cudaGetLastError): call it in the loaded libcudart, if one can be found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class PinnedPool:
    """Pinned host buffers of exactly the sizes asked for, reused step after step.

    torch's pinned allocator rounds each request up to a power of two and keeps every
    block for the life of the process (a [1, 32768, 5120] bf16 activation: 320 MiB
    asked, 512 MiB pinned, never given back, not even by `Engine.close()`). These are
    `host_buffer`s, registered at their size; `release()` (the engine's close) gives the
    free ones back. The caller orders reuse (activation offload: one side stream)."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self.made = 0  # buffers made so far (reuse makes none)

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        spare = self.free.get((numel, dtype))
        if spare:
            return spare.pop()
        self.made += 1
        return host_buffer(numel, dtype, True)

    def give(self, t: Tensor) -> None:
        self.free.setdefault((t.numel(), t.dtype), []).append(t.reshape(-1))

    def release(self) -> None:
        for ts in self.free.values():
            for t in ts:
                release_host_buffer(t)
        self.free.clear()


#: the process's pool (activation offload's stashes)
PINNED = PinnedPool()


__all__ = ["LONG_SEQUENCE_MMAP_MIB", "MAX_MMAP_THRESHOLD_MIB", "PINNED", "PinnedPool",
           "clear_cuda_error", "host_buffer", "mmap_threshold", "release_host_buffer",
           "return_freed_blocks"]
