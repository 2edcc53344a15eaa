"""`train.host_mmap_mb` (memory/host.py): with it, a freed host tensor of a few MiB goes
back to the OS; with glibc's default it stays in the heap once a larger block was freed.
Each case runs in a fresh interpreter (the setting is process-wide); glibc's own counters
(`mallinfo2`) are the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain.config import ConfigError, SequenceConfig, build_config
from zerotrain.memory.host import mmap_threshold, return_freed_blocks

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = r"""
import ctypes, json, sys
import torch
from zerotrain.memory.host import mmap_threshold, return_freed_blocks
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
for m in sys.argv[1].split(","):  # the settings of the engines built in this process
    took = return_freed_blocks(None if m == "none" else float(m))
M = 2**20
x = torch.empty(16 * M, dtype=torch.uint8)
del x  # a mapped block freed: glibc's threshold rises to 16 MiB
before = libc.mallinfo2()
keep = [torch.ones(8 * M, dtype=torch.uint8) for _ in range(4)]  # 32 MiB, touched
mid = libc.mallinfo2()
del keep
after = libc.mallinfo2()
print(json.dumps({"took": took, "mapped": (mid.hblkhd - before.hblkhd) / M,
                  "heap_used": (mid.uordblks - before.uordblks) / M,
                  "unmapped": (mid.hblkhd - after.hblkhd) / M}))
"""


def probe(mib: str, env: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    e.update(env or {}, PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", PROBE, mib], env=e, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_go_back_to_the_os():
    plain, fixed = probe("none"), probe("1")
    # glibc's default: the four 8 MiB tensors are carved from the heap (whether it grows
    # for them depends on what the imports left free in it: not held), where a freed
    # block stays unless it borders the heap's top
    assert plain["mapped"] == 0 and plain["heap_used"] >= 32, plain
    # 1 MiB: each one its own map, unmapped when freed; none of them from the heap
    assert fixed["took"] and fixed["mapped"] >= 32 and fixed["unmapped"] >= 32, fixed
    assert fixed["heap_used"] < 1, fixed
    # an engine without the setting after one with it: glibc's (risen) default again
    after = probe("1,none")
    assert not after["took"] and after["mapped"] == 0 and after["heap_used"] >= 32, after
    # the user's environment wins: nothing set, glibc as by default
    env = probe("1", {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)})
    assert env["took"] is False and env["mapped"] == 0


def test_bad_values():
    assert return_freed_blocks(None) is False
    with pytest.raises(ValueError, match=r"train\.host_mmap_mb"):
        return_freed_blocks(64)
    with pytest.raises(ConfigError, match="host_mmap_mb"):
        build_config({"train": {"host_mmap_mb": 0}})
    assert build_config({"train": {"host_mmap_mb": None}}).train.host_mmap_mb is None
    assert build_config({}).train.host_mmap_mb == "auto"


def test_auto_is_for_long_sequences_only():
    """auto: 4 MiB with tiles or sequence parallelism (long-sequence runs, where the heap
    fragments; above the CPU optimizer's 1 MiB blocks), glibc's default otherwise
    (short-lived maps cost the main job ~35%)."""
    def seq(tile, sp):
        return SequenceConfig(tile_tokens=tile, parallel=sp)

    assert mmap_threshold("auto", seq(None, 1)) is None
    assert mmap_threshold("auto", seq(2048, 1)) == mmap_threshold("auto", seq(None, 2)) == 4.0
    assert mmap_threshold(4, seq(None, 1)) == 4.0 and mmap_threshold(None, seq(2048, 2)) is None


STEP_PROBE = r"""
import json, sys
import torch
from zerotrain.config import SequenceConfig
from zerotrain.memory.host import mmap_threshold, return_freed_blocks
from zerotrain.optim.optimizers import AdamW
torch.set_num_threads(1)
assert return_freed_blocks(mmap_threshold("auto", SequenceConfig(parallel=2)))
p = torch.zeros(1 << 21)
p.grad = torch.randn(1 << 21)
opt = AdamW([p], lr=1e-3, compiled=False)
opt.step()
def faults():
    return int(open("/proc/self/stat").read().split()[9])
f0 = faults()
for _ in range(4):  # the mean of several steps: one heap growth is not a per-step cost
    opt.step()
f1 = faults()
M = 2**20
big = torch.ones(16 * M, dtype=torch.uint8)
f2 = faults(); del big; big = torch.ones(16 * M, dtype=torch.uint8); f3 = faults()
print(json.dumps({"step": (f1 - f0) / 4, "big": f3 - f2}))
"""


def test_auto_leaves_the_cpu_optimizers_blocks_in_the_heap():
    """S-1: under `auto` for a long-sequence run, ZeRO-Offload's CPU AdamW (1 MiB fp32
    temporaries per block) must not map and fault in every temporary — at 1 MiB it took
    ~257 faults per block and 2.2-2.9x the step time — while a 16 MiB tensor is still
    its own map (faulted in afresh after a free: returned to the OS)."""
    e = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    e.update(PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", STEP_PROBE], env=e, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] < 100, got  # 8 blocks: ~2,000 at 1 MiB
    assert got["big"] >= 16 * 2**20 // 4096 * 0.9, got  # 16 MiB, mapped anew
