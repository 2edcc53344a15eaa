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

import ctypes
import ctypes.util
import functools
import os

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


__all__ = ["LONG_SEQUENCE_MMAP_MIB", "MAX_MMAP_THRESHOLD_MIB", "mmap_threshold",
           "return_freed_blocks"]
