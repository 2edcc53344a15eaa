"""ZeRO-1 — over stage 0: optimizer states (and FP32 master weights) sharded 1/N.

Gradients still accumulate in full, but on the boundary each unit is reduce-scattered
(never all-reduced): rank r receives only the summed chunk r, which is all its
optimizer shard needs. After the update, each rank's new weights are all-gathered.
Reduce-scatter + all-gather is exactly the traffic of one all-reduce.
"""

from __future__ import annotations

from zerotrain.config.zero_facts import STAGE_SHARDS
from zerotrain.zero.ddp import DDP
from zerotrain.zero.unit import Unit


class ZeRO1(DDP):
    name = "zero1"
    stage = 1
    shards = STAGE_SHARDS[1]

    def reduce_grads(self, u: Unit) -> None:
        buf = u.grad
        lo, hi = u.shard_range
        if buf.dtype == self.policy.reduce_dtype:  # in place: chunk r of the buffer
            self.enqueue(u.part.comm.grads.reduce_scatter(buf[lo:hi], buf, async_op=True))
            return
        wire = buf.to(self.policy.reduce_dtype)
        out = wire[lo:hi]
        self.enqueue(u.part.comm.grads.reduce_scatter(out, wire, async_op=True),
                     lambda: buf[lo:hi].copy_(out))

    def publish(self, u: Unit) -> None:
        lo, hi = u.shard_range
        own = u.params[lo:hi]
        self.write_master_into(u, own)
        self.enqueue(u.part.comm.all_gather(u.params, own, async_op=True))
