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
        self._pool: dict[int, list[Tensor]] = {}  # released buckets, by size

    def grad_target(self, u: FlatUnit) -> Tensor:
        """The unit's bucket, taken when its first gradient arrives. The other parameters'
        .grad become views of it, so autograd accumulates their gradients in place."""
        b = self._bucket[u.index]
        if b is None:
            free = self._pool.get(u.padded_numel)
            b = free.pop() if free else torch.empty(
                u.padded_numel, dtype=self.policy.reduce_dtype, device=self.device)
            b.zero_()
            self._bucket[u.index] = b
            if b.dtype == self.policy.param_dtype:
                for i, s in enumerate(u.slots):
                    if i not in self._ready[u.index] and s.param.grad is None:
                        s.param.grad = u.view_of(b, s)
        return b

    def _release(self, u: FlatUnit) -> None:
        for s in u.slots:
            s.param.grad = None
        b, self._bucket[u.index] = self._bucket[u.index], None
        free = self._pool.setdefault(u.padded_numel, [])
        if b is not None and len(free) <= self.max_in_flight:  # reused: no fresh pages
            free.append(b)

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
            self._release(u)

        self.enqueue(self.comm.reduce_scatter(out, bucket, async_op=True), done)

    def owned_grad(self, u: FlatUnit) -> Tensor:
        return self.grad_shard[u.index]

    def clear_grads(self) -> None:
        for g in self.grad_shard:
            g.zero_()
        self._shard_dirty = [False] * len(self.units)

    def grad_tensors(self) -> list[Tensor]:
        return list(self.grad_shard)
