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

Where shards live between uses and how they travel — the wire, hpZ's node-local copy,
a tier (ZeRO-Infinity's `zero.offload_param`) — is the parameter store's
(zero/params/store.py); this class decides only when a unit is gathered and released.
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
from zerotrain.zero.cut import UnitSpec, blocks
from zerotrain.zero.flat import NamedParams
from zerotrain.zero.params.store import ParamStore
from zerotrain.zero.params.tiered import ParamTier
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

    def __init__(self, *args, param_tier: ParamTier | None = None, **kwargs):
        """`param_tier` (zero/params/tiered.py): where shards live between uses (default:
        here, on the device)."""
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
        self.store = ParamStore(self.comm, self.units, self.wire, param_tier,
                                self.cfg.secondary_partition, self.cfg.prefetch,
                                self.policy.param_dtype.itemsize)
        self.after_publish()  # the wire packs the first gathers' bytes
        self.tier_bytes()  # the first writes are the build's, not a step's

    @classmethod
    def cut(cls, model: nn.Module, plan: Plan, named: NamedParams, cfg: ZeroConfig,
            policy: PrecisionPolicy) -> list[UnitSpec]:
        """The plan's blocks, plus a root unit for everything else."""
        return blocks(model, plan, named)

    def gather(self, u: ShardedUnit, forward: bool) -> None:
        self.store.gather(u, forward, self._neighbour)

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
        self.store.release(u, after_forward=True)
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
        self.store.reduced(u)

    def after_backward(self) -> None:
        self.store.end_backward()

    def publish(self, u: ShardedUnit) -> None:
        self.store.publish(u, self.write_master_into, self.enqueue)

    def after_publish(self) -> None:
        self.store.refresh()

    @contextmanager
    def full_parameters(self, params: Any = None) -> Iterator[None]:
        """Every unit gathered, exactly, inside the block (all ranks must enter it); with
        `params`, only the units holding one of them (a script touching one embedding
        does not need the whole model on every GPU)."""
        with self.store.full(self.units_of(params)):
            yield

    def units_of(self, params: Any = None) -> list:
        """The units holding any of `params` (all of them for None)."""
        if params is None:
            return self.units
        ids = {id(p) for p in params}
        return [u for u in self.units if any(id(s.param) in ids for s in u.slots)]

    def gathered_bytes(self) -> int:
        return self.store.gathered_bytes()

    def param_tiers(self) -> list[Any]:
        return self.store.moving_tiers()
