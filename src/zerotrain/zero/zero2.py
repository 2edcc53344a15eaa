"""ZeRO-2 — gradients sharded too.

A parameter's gradient is copied into its unit's transient bucket as soon as autograd
produces it (and the parameter's own .grad is dropped). When the bucket is complete it
is reduce-scattered straight away, during the backward, and only this rank's shard is
kept. Because full gradients never persist, this happens on every micro-step; the
shard is where accumulation happens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotrain.zero.flat import FlatUnit
from zerotrain.zero.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    name = "zero2"
    stage = 2
    shards_grads = True
    communicates_every_micro_step = True

    def init_grads(self) -> None:
        self.grad_shard = [self.alloc_host(u.shard_numel, self.policy.grad_dtype)
                           for u in self.units]
        self._bucket: list[Tensor | None] = [None] * len(self.units)
        self._shard_dirty = [False] * len(self.units)

    def grad_target(self, u: FlatUnit) -> Tensor:
        b = self._bucket[u.index]
        if b is None:
            b = torch.zeros(u.padded_numel, dtype=self.policy.reduce_dtype, device=self.device)
            self._bucket[u.index] = b
        return b

    def launch(self, u: FlatUnit) -> None:
        bucket = self.grad_target(u)
        shard = self.grad_shard[u.index]
        # First contribution since zero_grad: reduce straight into the shard.
        direct = (not self._shard_dirty[u.index] and shard.dtype == bucket.dtype
                  and shard.device == bucket.device)
        out = shard if direct else torch.empty(u.shard_numel, dtype=bucket.dtype,
                                               device=self.device)
        self._shard_dirty[u.index] = True

        def done() -> None:
            if not direct:
                shard.add_(out.to(shard.device))
            self._bucket[u.index] = None

        self.enqueue(self.comm.reduce_scatter(out, bucket, async_op=True), done)

    def owned_grad(self, u: FlatUnit) -> Tensor:
        return self.grad_shard[u.index]

    def clear_grads(self) -> None:
        for g in self.grad_shard:
            g.zero_()
        self._shard_dirty = [False] * len(self.units)

    def grad_tensors(self) -> list[Tensor]:
        return list(self.grad_shard)
