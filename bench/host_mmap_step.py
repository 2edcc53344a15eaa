"""S-1 (gpu-review-3): ZeRO-Offload's CPU AdamW step under `train.host_mmap_mb`.

The blocked eager update (optim/batching.py) makes fp32 temporaries of exactly 1 MiB per
block; a glibc mmap threshold at or below that maps (and faults in, and unmaps) every
one. Prints the median step time, its CPU time (user + system: what a loaded machine
does not inflate) and the minor page faults of one step for: glibc's
default, what `auto` resolves to for a long-sequence run (SP or tiles), and 1 MiB.

    PYTHONPATH=src python bench/host_mmap_step.py default|auto|MIB [--n 24] [--reps 7]

Run each mode in its own process: the threshold is the process's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerotrain.config import SequenceConfig
from zerotrain.memory.host import mmap_threshold, return_freed_blocks
from zerotrain.optim.optimizers import AdamW


def minor_faults() -> int:
    return int(open("/proc/self/stat").read().split()[9])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--n", type=int, default=24, help="log2 of the parameter count")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mode == "auto":
        mib = mmap_threshold("auto", SequenceConfig(parallel=2))
    else:
        mib = None if a.mode == "default" else float(a.mode)
    if mib is not None:
        assert return_freed_blocks(mib)
    p = torch.zeros(1 << a.n)
    p.grad = torch.randn(1 << a.n)
    opt = AdamW([p], lr=1e-3, compiled=False)
    opt.step()
    times, cpu = [], []
    for _ in range(a.reps):
        t, c = time.perf_counter(), time.process_time()
        opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    f0 = minor_faults()
    opt.step()
    faults = minor_faults() - f0
    print(f"{a.mode} (threshold {mib} MiB): median step {statistics.median(times) * 1e3:.0f} ms "
          f"(min {min(times) * 1e3:.0f}), CPU time (user+sys) median "
          f"{statistics.median(cpu) * 1e3:.0f} ms, minor faults per step {faults}")


if __name__ == "__main__":
    main()
