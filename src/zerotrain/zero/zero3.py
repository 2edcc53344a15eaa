"""ZeRO-3 — over ZeRO-2: parameters sharded too; they exist in full only while a unit runs.

The model's plan names its blocks; each block is a unit, and everything outside the
blocks (embeddings, final norm, a tied head) forms one root unit. Module hooks drive a
unit's life with FSDP-like verbs (`zero/unit.py`):

  forward:  pre-hook   unshard (or wait for the prefetch), prefetch the next unit
            post-hook  reshard; hook the outputs so backward can call us back
  backward: output-grad hook  unshard again, prefetch the previous unit
            gradients complete  reduce-scatter them (ZeRO-2), reshard

"Next" is what the model actually runs, not what the plan lists: the first forward
records the order in which units are gathered (pre-hooks) and finished (post-hooks), as
FSDP does; from then on forward prefetches the recorded next unit and backward the next
in reverse finishing order (the root, which wraps everything, finishes last and so comes
first). Until the record is complete (the first forward) the plan's order is the guess.

Units smaller than `zero.param_persistence_threshold` elements stay gathered (their
traffic would be all latency); they are all-gathered after each update, as in ZeRO-2.

With `zero.offload_param` (ZeRO-Infinity) each unit's shard lives in a tier between uses
(`param_tier`, zero/infinity.py): made ready before the unit's gather, released after
it, fetched `zero.offload_prefetch` units ahead so the read runs while units compute
(the gather then waits for nothing but its own collective: no gather prefetch), and
written back after the update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from zerotrain.config import ZeroConfig
from zerotrain.config.zero_facts import STAGE_SHARDS
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim.compact import convert_state
from zerotrain.zero.cut import UnitSpec, blocks
from zerotrain.zero.flat import NamedParams, gather_range
from zerotrain.zero.hpz import SecondaryPartition
from zerotrain.zero.infinity import Streamed, Tiers
from zerotrain.zero.lazy import Lazy, from_tier
from zerotrain.zero.tier import Tier
from zerotrain.zero.unit import ShardedUnit, UnitState
from zerotrain.zero.zero2 import ZeRO2


def in_backward() -> bool:
    """True while autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class ZeRO3(ZeRO2):
    name = "zero3"
    stage = 3
    shards = STAGE_SHARDS[3]
    unit_class = ShardedUnit
    units: list[ShardedUnit]

    def __init__(self, *args, tiers: Tiers | None = None, **kwargs):
        """`tiers` (zero/infinity.py): where shards live between uses (default: here, on
        the device) and where the `Streamed` updater keeps masters and moments."""
        self.tiers = tiers or Tiers(None, None)
        self.param_tier = self.tiers.params
        super().__init__(*args, **kwargs)
        self._root = next((u for u in self.units if u.module is self.model), None)
        self._blocks = [u for u in self.units if u is not self._root]  # the plan's order
        self._started: list[ShardedUnit] = []   # first forward: units by pre-hook
        self._finished: list[ShardedUnit] = []  # first forward: units by post-hook
        #: once recorded: each unit's next unit in forward, and in backward
        self._next: tuple[dict, dict] | None = None
        for u in self.units:
            assert u.module is not None
            u.module.register_forward_pre_hook(partial(self._pre_forward, u))
            u.module.register_forward_hook(partial(self._post_forward, u))
        k = self.cfg.secondary_partition
        self.hpz = SecondaryPartition(self.comm, k) if k else None
        self.wire.attach(self.units, self.policy.param_dtype.itemsize)
        self._wire_in_tier()
        self.after_publish()  # the wire packs the first gathers' bytes
        self.tier_bytes()  # the first writes are the build's, not a step's

    @classmethod
    def cut(cls, model: nn.Module, plan: Plan, named: NamedParams, cfg: ZeroConfig,
            policy: PrecisionPolicy) -> list[UnitSpec]:
        """The plan's blocks, plus a root unit for everything else."""
        return blocks(model, plan, named)

    def prefetch(self, u: ShardedUnit | None, forward: bool = True) -> None:
        if u is not None and self.cfg.prefetch and not self.param_tier.moves:
            self._unshard(u, forward, async_op=True)

    def _unshard(self, u: ShardedUnit, forward: bool, async_op: bool) -> None:
        """Start `u`'s gather: for the backward from hpZ's node-local copy when it has
        one, otherwise across every rank through the wire."""
        via = self.hpz.via(u) if self.hpz is not None and not forward else None
        u.unshard(u.part.comm, async_op=async_op, via=via)

    def gather(self, u: ShardedUnit, forward: bool) -> None:
        """Gather `u` now (its shard made ready from the tier first, released after),
        then start what comes next: the tier's reads `offload_prefetch` units ahead,
        else the next unit's gather."""
        self.param_tier.ready(u)
        if u.wire is not None:
            u.wire.ready(u.shard)
        self._unshard(u, forward, async_op=False)
        u.wait_unshard()
        self.param_tier.release(u)
        nxt = self._neighbour(u, forward)
        ahead = nxt
        for _ in range(self.param_tier.depth):
            if ahead is None:
                break
            self.param_tier.fetch(ahead)
            ahead = self._neighbour(ahead, forward)
        self.prefetch(nxt, forward)

    def _wire_in_tier(self) -> None:
        """FP8 gather with shards in a tier: each wire packs at its gather, from amaxes
        noted while the shard is in memory — here, read once from the tier."""
        if not self.param_tier.moves:
            return
        for u in self.units:
            if u.wire is not None and u.index in self.param_tier.placed:
                u.wire.lazy = True
                self.param_tier.ready(u)
                u.wire.note(u.shard)
                self.param_tier.release(u)

    def _neighbour(self, u: ShardedUnit, forward: bool) -> ShardedUnit | None:
        """The unit that runs after `u`: recorded from the first forward, else the plan's
        guess (root first, then blocks forward, or last-to-first backward)."""
        if self._next is not None:
            return self._next[0 if forward else 1].get(u)
        blocks = self._blocks
        if not blocks:
            return None
        if u is self._root:
            return blocks[0] if forward else blocks[-1]
        i = blocks.index(u) + (1 if forward else -1)
        return blocks[i] if 0 <= i < len(blocks) else None

    # ------------------------------------------------------------ module hooks
    def _record(self, seen: list[ShardedUnit], u: ShardedUnit) -> None:
        if self._next is None and u not in seen:
            seen.append(u)

    def _end_record(self) -> None:
        """The first forward is over: fix each unit's successor in both directions."""
        if self._next is None and self._started:
            back = self._finished[::-1]
            self._next = (dict(pairwise(self._started)), dict(pairwise(back)))

    def _pre_forward(self, u: ShardedUnit, module: nn.Module, args) -> None:
        if in_backward():  # activation-checkpoint recompute: gathered for backward already,
            if u.state is UnitState.SHARDED:  # unless nested in a block (expert units)
                u.gathered_for_backward = True
                self.gather(u, forward=False)
            return
        self._record(self._started, u)
        self.gather(u, forward=True)

    def _post_forward(self, u: ShardedUnit, module: nn.Module, args, output):
        if in_backward():
            return output
        if self.hpz is not None:
            self.hpz.keep(u)
        u.reshard()
        self._record(self._finished, u)
        if u is self._root:  # drop prefetches the forward never consumed
            self._end_record()
            for other in self.units:
                other.reshard()
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(partial(self._pre_backward, u))
        return output

    def _pre_backward(self, u: ShardedUnit, grad: Tensor) -> None:
        self._end_record()  # no root unit: the forward ended when backward began
        if not u.gathered_for_backward:
            u.gathered_for_backward = True
            self.gather(u, forward=False)

    # ------------------------------------------------------------ stage answers
    def reduce_grads(self, u: ShardedUnit) -> None:
        super().reduce_grads(u)
        u.reshard()
        if self.hpz is not None:
            self.hpz.drop(u)

    def after_backward(self) -> None:
        if self.hpz is not None:
            self.hpz.clear()
        for u in self.units:
            u.reshard()
            u.gathered_for_backward = False

    def publish(self, u: ShardedUnit) -> None:
        self.param_tier.overwrite(u)
        self.write_master_into(u, u.shard)
        if u.wire is not None:
            u.wire.note(u.shard)
        self.param_tier.written(u)
        if u.persistent:
            self.enqueue(u.part.comm.all_gather(u.params, u.shard, async_op=True))

    def after_publish(self) -> None:
        super().after_publish()
        self.param_tier.settle_all()

    @contextmanager
    def full_parameters(self, params: Any = None) -> Iterator[None]:
        """Every unit gathered, exactly, inside the block (all ranks must enter it); with
        `params`, only the units holding one of them (a script touching one embedding
        does not need the whole model on every GPU)."""
        units = self.units_of(params)
        for u in units:
            self.param_tier.ready(u)
            u.unshard(u.part.comm, async_op=False, exact=True)
            self.param_tier.release(u)
        try:
            yield
        finally:
            for u in units:
                u.reshard()

    def units_of(self, params: Any = None) -> list:
        """The units holding any of `params` (all of them for None)."""
        if params is None:
            return self.units
        ids = {id(p) for p in params}
        return [u for u in self.units if any(id(s.param) in ids for s in u.slots)]

    def gathered_bytes(self) -> int:
        return sum(u.gathered_bytes() for u in self.units)

    # ------------------------------------------------------------ offload tiers
    def moving_tiers(self) -> list[Tier]:
        """The tiers that really move bytes (each once: both parts may share one)."""
        found = [self.param_tier.tier, self.tiers.opt]
        return list({id(t): t for t in found if t is not None and t.moves}.values())

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each tier read and wrote since the last call (the engine's step)."""
        return {t.kind: t.counter.take() for t in self.moving_tiers()}

    # Gradients in a tier (`TierGrads`): the norm from the norms taken as they landed,
    # the clipping factor applied when each shard is read back for its update.
    def grad_norm_sq(self) -> float:
        norm_sq = getattr(self.grads, "norm_sq", None)
        if norm_sq is None:
            return super().grad_norm_sq()
        local = self.comm.all_reduce_scalars(norm_sq(self.units, self.host).reshape(1))[0]
        return float(local)

    def scale_grads(self, factor: float) -> None:
        scale = getattr(self.grads, "scale", None)
        if scale is None:
            super().scale_grads(factor)
        else:
            scale(factor)

    def describe(self) -> list[str]:
        return super().describe() + [line for t in self.moving_tiers() for line in t.describe()]

    # A checkpoint reads and writes masters and moments one at a time: those in a tier
    # (`Streamed`) are `Lazy` tensors read from it when written out, and a load fills
    # them unit by unit, each sent back before the next; the format stays the tiers'-free.
    def lazy_states(self) -> dict[int, Lazy]:
        """By id of its tensor: every master and moment that lives in a tier."""
        if not isinstance(self.updater, Streamed):
            return {}
        return {id(p.t): from_tier(p) for p in self.updater.placed_all() if p.moves}

    def state_dict(self, lazy: bool = False) -> dict[str, Tensor]:
        """`lazy`: states in a tier stay there (the caller wraps them: `lazy_states`)."""
        if not lazy:
            self.updater.resident()
        return super().state_dict()

    def load_state_dict(self, sd: dict[str, Tensor | Lazy]) -> None:
        if not isinstance(self.updater, Streamed):
            return super().load_state_dict({k: v.load() if isinstance(v, Lazy) else v
                                            for k, v in sd.items()})

        def master(u: ShardedUnit) -> Tensor:
            v = sd[f"master.{u.index}"]
            return v.load() if isinstance(v, Lazy) else v
        self._fill_masters(master)

    def load_weights(self, read, only: set[int] | None = None) -> None:
        if not isinstance(self.updater, Streamed):
            return super().load_weights(read, only)
        self._fill_masters(lambda u: gather_range(u.layout(), *self.opt_range(u), read,
                                                  u.master.dtype), only)

    def _fill_masters(self, value, only: set[int] | None = None) -> None:
        """Each unit's master from `value(u)`, published, and (in a tier) sent back
        before the next unit's is read."""
        up = self.updater
        assert isinstance(up, Streamed)
        up.placed_all()
        with torch.no_grad():
            for u in self.units_of_index(only):
                p = up.masters.get(u.index)
                if p is not None:
                    p.claim()
                u.master.copy_(value(u))
                self.publish(u)
                up.evict(u)
                up.settle(u)
            self.wait_pending()
        self.after_publish()

    def fill_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer's load: its `Lazy` moments read one unit at a time, each
        bound to its home in the tier and sent back before the next."""
        up = self.updater
        if not isinstance(up, Streamed):
            return
        self._optimizer = optimizer
        compact = getattr(optimizer, "compact", None)  # compact states keep their dtypes
        keep = compact is not None and compact.active
        for u in self.units:
            views = [v for seg, v in self.opt_segments if seg.unit == u.index]
            for view in views:
                st = optimizer.state.get(view, {})
                for name, v in list(st.items()):
                    if isinstance(v, Lazy):
                        t = v.load().to(device=view.device)
                        cast = view.is_floating_point() and not keep
                        st[name] = t.to(view.dtype) if cast else t
                if keep and st:
                    convert_state(st, view, compact)
            up.placed_all()
            up.evict(u)
            up.settle(u)

    def weights_finite(self) -> bool:
        away = self.lazy_states()

        def master(u: ShardedUnit) -> Tensor:
            v = away.get(id(u.master))
            return u.master if v is None else v.load()
        bad = any(not bool(torch.isfinite(master(u)).all()) for u in self.units)
        return float(self.comm.all_reduce_scalars([float(bad)], op="max")[0]) == 0.0

    def close(self) -> None:
        try:
            super().close()
        finally:
            for t in self.moving_tiers():
                t.close()
