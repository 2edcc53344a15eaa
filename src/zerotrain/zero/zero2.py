"""ZeRO-2 — over ZeRO-1: gradients sharded too (`ShardedGrads`).

A parameter's gradient lands in its unit's transient bucket as soon as autograd
produces it (and the parameter's own .grad is dropped). When the bucket is complete it
is reduce-scattered straight away, during the backward, and only this rank's shard is
kept. Because full gradients never persist, this happens on every micro-step; the
shard is where accumulation happens.
"""

from __future__ import annotations

from zerotrain.config.zero_facts import STAGE_SHARDS
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.states.grads import ShardedGrads
from zerotrain.zero.unit import Unit
from zerotrain.zero.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    name = "zero2"
    stage = 2
    shards = STAGE_SHARDS[2]
    grads_class = ShardedGrads

    @classmethod
    def grads_options(cls, policy: PrecisionPolicy, in_flight: int) -> dict:
        return {"bucket_dtype": policy.reduce_dtype, "pool_size": in_flight}

    def reduce_grads(self, u: Unit) -> None:
        bucket = self.grads.target(u)
        out, done = self.grads.landing(u)
        self.enqueue(self.grad_wire.reduce_scatter(u.part.comm.grads, out, bucket), done)
