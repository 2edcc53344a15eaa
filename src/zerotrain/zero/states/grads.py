"""Where gradients live between backward and the optimizer — one object per policy.

Like nanotron's gradient accumulator, gradients get their own object instead of being
spread over the strategy:

- `FullGrads` (stages 0–1): one persistent full-size buffer per unit (`unit.grad`).
  Micro-steps accumulate into it; it is reduced once, at the accumulation boundary.
- `ShardedGrads` (stages 2–3): a unit's gradients land in a transient full-size bucket
  taken from a pool, which is reduce-scattered on every micro-step; only this rank's
  shard (`unit.grad`) persists, and accumulation happens there. Offload's `HostGrads`
  (zero/states/host.py) keeps the shard in host memory.

Both answer the same questions: where does a parameter's gradient accumulate
(`target`), what the optimizer reads (`unit.grad`, in the coordinates of
`unit.master`), and how to clear for the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from zerotrain.optim import foreach
from zerotrain.zero.unit import Unit


class FullGrads:
    """Stages 0–1: full gradients, reduced at the accumulation boundary."""

    every_micro_step = False
    sharded = False

    def __init__(self, dtype: torch.dtype, device: torch.device,
                 host: torch.device | None = None):
        self.dtype, self.device = dtype, device
        self.host = host or device

    def allocate(self, u: Unit) -> None:
        u.grad = torch.zeros(u.padded_numel, dtype=self.dtype, device=self.device)
        u.install_grads(u.grad)

    def target(self, u: Unit) -> Tensor:
        """The full-size buffer the unit's parameter gradients accumulate into."""
        return u.grad

    def owned(self, u: Unit, lo: int, hi: int) -> Tensor:
        """The gradient covering [lo, hi) of the unit (the optimizer's range)."""
        return u.grad[lo:hi]

    def release(self, u: Unit) -> None:
        """After the unit's reduction: nothing to give back."""

    def clear(self, units: list[Unit]) -> None:
        """Zero every unit's gradient (one multi-tensor kernel per device and dtype)."""
        foreach.zero_([u.grad for u in units])
        for u in units:
            u.grad_dirty = False

    def norm_sq(self, units: list[Unit], owned: Callable[[], list[Tensor]],
                device: torch.device) -> Tensor:
        """Σ‖owned gradient‖² over this rank's share (a home that keeps the shards away
        answers from norms taken as they landed)."""
        return foreach.sum_of_squares(owned(), device)

    def scale(self, owned: Callable[[], list[Tensor]], factor: float) -> None:
        foreach.scale_(owned(), factor)

    def drain(self) -> None:
        """End of backward: finish any copy still landing (Offload on a GPU)."""

    def close(self) -> None:
        """Release what the gradients hold outside torch's allocators (Offload)."""


class ShardedGrads(FullGrads):
    """Stages 2–3: a bucket pool for the backward, the owned shard across micro-steps."""

    every_micro_step = True
    sharded = True

    def __init__(self, dtype: torch.dtype, device: torch.device,
                 host: torch.device | None = None, bucket_dtype: torch.dtype | None = None,
                 pool_size: int = 2):
        super().__init__(dtype, device, host)
        self.bucket_dtype = bucket_dtype or dtype
        self.pool: dict[int, list[Tensor]] = {}  # released buckets by size: warm pages
        self.pool_size = pool_size

    def allocate(self, u: Unit) -> None:
        """The shard is never zeroed: each backward's first reduction writes it whole
        (`landing`), later micro-steps add. So it is left uninitialised — on a CPU a large
        allocation's pages then become resident only at the first backward, as optimizer
        states do at the first step, and init holds no gradient memory."""
        u.grad = torch.empty(u.shard_numel, dtype=self.dtype, device=self.host)

    def target(self, u: Unit) -> Tensor:
        """The unit's bucket, taken when its first gradient arrives. The other parameters'
        .grad become views of it, so autograd accumulates their gradients in place."""
        if u.bucket is None:
            free = self.pool.get(u.padded_numel)
            b = free.pop() if free else torch.empty(
                u.padded_numel, dtype=self.bucket_dtype, device=self.device)
            b.zero_()
            u.bucket = b
            u.install_grads(b)
        return u.bucket

    def landing(self, u: Unit) -> tuple[Tensor, Callable[[], None]]:
        """Where this micro-step's reduced shard lands, and what to do once it has.

        The first contribution since `clear` overwrites the shard — straight into it when
        dtype and device agree, else copied from a temporary; later ones (accumulation)
        land in a temporary that is added to it.
        """
        bucket, shard = self.target(u), u.grad
        first = not u.grad_dirty
        direct = first and shard.dtype == bucket.dtype and shard.device == bucket.device
        out = shard if direct else torch.empty(u.shard_numel, dtype=bucket.dtype,
                                               device=self.device)
        u.grad_dirty = True

        def done() -> None:
            if first and not direct:
                shard.copy_(out)
            elif not direct:
                shard.add_(out.to(shard.device))
            self.release(u)
        return out, done

    def clear(self, units: list[Unit]) -> None:
        """Nothing to zero: the next backward's first reduction overwrites each shard."""
        for u in units:
            u.grad_dirty = False

    def owned(self, u: Unit, lo: int, hi: int) -> Tensor:
        return u.grad

    def release(self, u: Unit) -> None:
        for s in u.slots:
            s.param.grad = None
        b, u.bucket = u.bucket, None
        free = self.pool.setdefault(u.padded_numel, [])
        if b is not None and len(free) <= self.pool_size:  # reused: no fresh pages
            free.append(b)
