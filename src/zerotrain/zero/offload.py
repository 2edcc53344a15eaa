"""ZeRO-Offload — over ZeRO-2 or ZeRO-3: the optimizer's world moves to host memory.

The gradient shard, the FP32 master shard and the optimizer states are allocated on the
host (pinned when the device is a GPU, so copies are asynchronous DMA). The host CPU
runs the update — it is memory-bound, few flops per byte, a good fit for the CPU — and
only the half-precision parameter shard goes back to the device. Per step: gradients
go down once, parameters come up once.

The placement itself is the one `host` device every stage already allocates master and
gradient shards on (`Strategy.host`); these classes only switch it. On a CPU-only
machine host and device are the same memory, so the split is logical (and still shown
by the audit).
"""

from __future__ import annotations

from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3


class ZeRO2Offload(ZeRO2):
    name = "zero2-offload"
    offload = True


class ZeRO3Offload(ZeRO3):
    name = "zero3-offload"
    offload = True
