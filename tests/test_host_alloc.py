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

from zerotrain.config import ConfigError, build_config
from zerotrain.memory.host import return_freed_blocks

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = r"""
import ctypes, json, sys
import torch
from zerotrain.memory.host import return_freed_blocks
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
took = return_freed_blocks(float(sys.argv[1])) if sys.argv[1] != "none" else False
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
    assert build_config({}).train.host_mmap_mb == 1.0
