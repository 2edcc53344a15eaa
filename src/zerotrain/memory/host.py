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

`return_freed_blocks(mib)` fixes the threshold (glibc's `mallopt(M_MMAP_THRESHOLD)`,
which also stops it from rising) and the heap's trim threshold: blocks of `mib` MiB and
more are mapped and given back when freed. The engine calls it with
`train.host_mmap_mb` unless the user's environment already sets glibc's
`MALLOC_MMAP_THRESHOLD_` (that choice wins). Without glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
MAX_MMAP_THRESHOLD_MIB = 32


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") \
        else None


def return_freed_blocks(mib: float | None) -> bool:
    """Blocks of at least `mib` MiB from their own memory maps, returned when freed (the
    module doc). Returns whether glibc took the setting; False when `mib` is None, the
    environment sets `MALLOC_MMAP_THRESHOLD_`, or the C library is not glibc."""
    if mib is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if not 0 < mib <= MAX_MMAP_THRESHOLD_MIB:
        raise ValueError(f"train.host_mmap_mb must be in (0, {MAX_MMAP_THRESHOLD_MIB}] "
                         f"(glibc's limit), got {mib}; null leaves glibc's default")
    libc = _libc()
    if libc is None:
        return False
    size = ctypes.c_int(int(mib * 2**20))
    ok = libc.mallopt(M_MMAP_THRESHOLD, size) == 1
    # the heap's top is given back above the same size (the rising threshold had raised
    # this one too, to twice itself)
    return bool(ok and libc.mallopt(M_TRIM_THRESHOLD, size) == 1)


__all__ = ["MAX_MMAP_THRESHOLD_MIB", "return_freed_blocks"]
