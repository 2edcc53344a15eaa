"""Stage 0 — data parallelism: every rank keeps everything, gradients are all-reduced.

Gradients accumulate in full (`FullGrads`); a unit's all-reduce starts as soon as its
last gradient lands (overlapping the rest of the backward), and only on the
accumulation boundary: earlier micro-steps just accumulate locally.

Checkpoints: every rank holds the whole state, but each writes only its shard of it
(`write_range`, zero/state.py), so a checkpoint holds it once whatever the rank count.
"""

from __future__ import annotations

from zerotrain.zero.base import Strategy
from zerotrain.zero.unit import Unit


class DDP(Strategy):
    name = "ddp"
    stage = 0

    def reduce_grads(self, u: Unit) -> None:
        buf = u.grad
        if buf.dtype == self.policy.reduce_dtype:
            self.enqueue(u.part.comm.grads.all_reduce(buf, async_op=True))
            return
        wire = buf.to(self.policy.reduce_dtype)
        self.enqueue(u.part.comm.grads.all_reduce(wire, async_op=True), lambda: buf.copy_(wire))
