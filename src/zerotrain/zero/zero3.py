"""ZeRO-3 — parameters sharded too: they exist in full only while a unit runs.

The model is cut into units (by default each child of its largest `nn.ModuleList`, i.e.
each transformer block, plus a root unit holding everything else such as embeddings,
final norm and a tied head). Module hooks drive the life of a unit's full buffer:

  forward:  pre-hook  all-gather (or wait for the prefetch), prefetch the next unit
            post-hook free; hook the outputs so backward can call us back
  backward: output-grad hook  all-gather again, prefetch the previous unit
            last gradient of the unit  reduce-scatter it, free the parameters

"Free" releases the storage (`resize_(0)`) while every parameter view stays valid, so
autograd's saved references see the re-gathered values. Units smaller than
`zero.param_persistence_threshold` elements stay gathered (their traffic would be all
latency); they are all-gathered after each update, as in ZeRO-2.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from zerotrain.comm.collectives import Handle
from zerotrain.zero.base import NamedParams, in_backward
from zerotrain.zero.flat import FlatUnit
from zerotrain.zero.zero2 import ZeRO2


def wrap_modules(model: nn.Module) -> list[nn.Module]:
    """Default wrap policy: the children of the largest ModuleList (the blocks)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


class ZeRO3(ZeRO2):
    name = "zero3"
    stage = 3
    shards_params = True

    def make_units(self, named: NamedParams) -> list[tuple[str, NamedParams]]:
        blocks = wrap_modules(self.model)
        taken: set[int] = set()
        per_block: list[NamedParams] = []
        for m in blocks:
            ids = {id(p) for p in m.parameters()}
            mine = [t for t in named if id(t[1]) in ids and id(t[1]) not in taken]
            taken |= {id(t[1]) for t in mine}
            per_block.append(mine)
        root = [t for t in named if id(t[1]) not in taken]
        self.shard_param: list[Tensor] = []  # filled by make_master, one per unit
        self._persistent: list[bool] = []
        units, self._unit_modules = [], []
        if root:
            units.append(("root", root))
            self._unit_modules.append(self.model)
        for i, (m, ps) in enumerate(zip(blocks, per_block)):
            if ps:
                units.append((f"block{i}", ps))
                self._unit_modules.append(m)
        return units

    def make_master(self, u: FlatUnit) -> Tensor:
        lo, hi = u.shard_range
        persistent = u.numel < self.cfg.param_persistence_threshold
        # A persistent unit keeps its full buffer, so its shard can simply be a view of it.
        shard = u.flat[lo:hi] if persistent else u.flat[lo:hi].clone()
        self.shard_param.append(shard)
        self._persistent.append(persistent)
        return self.master_for(shard)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gathering: dict[int, Handle] = {}
        self._bw_gathered = [False] * len(self.units)
        root_is_model = bool(self._unit_modules) and self._unit_modules[0] is self.model
        self._root = 0 if root_is_model else None
        self._blocks = [u for u in self.units if u.index != self._root]  # execution order
        for u, m in zip(self.units, self._unit_modules):
            m.register_forward_pre_hook(partial(self._pre_forward, u))
            m.register_forward_hook(partial(self._post_forward, u))
            if not self._persistent[u.index]:
                u.free()

    # ------------------------------------------------------------ gather / free
    def _gather(self, u: FlatUnit, async_op: bool) -> None:
        if self._persistent[u.index] or u.index in self._gathering or u.is_allocated():
            return
        u.allocate()
        h = self.comm.all_gather(u.flat, self.shard_param[u.index], async_op=async_op)
        if async_op:
            self._gathering[u.index] = h

    def _ensure_gathered(self, u: FlatUnit) -> None:
        h = self._gathering.pop(u.index, None)
        if h is not None:
            h.wait()
        else:
            self._gather(u, async_op=False)

    def _free(self, u: FlatUnit) -> None:
        if self._persistent[u.index]:
            return
        h = self._gathering.pop(u.index, None)
        if h is not None:
            h.wait()
        if u.is_allocated():
            u.free()

    def _neighbour(self, u: FlatUnit, forward: bool) -> FlatUnit | None:
        """Execution order: root first, then blocks forward (or last-to-first backward)."""
        blocks = self._blocks
        if not self.cfg.prefetch or not blocks:
            return None
        if u.index == self._root:
            return blocks[0] if forward else blocks[-1]
        i = blocks.index(u) + (1 if forward else -1)
        return blocks[i] if 0 <= i < len(blocks) else None

    # ------------------------------------------------------------ module hooks
    def _pre_forward(self, u: FlatUnit, module: nn.Module, args) -> None:
        if in_backward():  # activation-checkpoint recompute: gathered for backward already
            return
        self._ensure_gathered(u)
        nxt = self._neighbour(u, forward=True)
        if nxt is not None:
            self._gather(nxt, async_op=True)

    def _post_forward(self, u: FlatUnit, module: nn.Module, args, output):
        if in_backward():
            return output
        self._free(u)
        if u.index == self._root:  # drop prefetches the forward never consumed
            for other in self.units:
                self._free(other)
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(partial(self._pre_backward, u))
        return output

    def _pre_backward(self, u: FlatUnit, grad: Tensor) -> None:
        if not self._bw_gathered[u.index]:
            self._bw_gathered[u.index] = True
            self._ensure_gathered(u)
            nxt = self._neighbour(u, forward=False)
            if nxt is not None:
                self._gather(nxt, async_op=True)

    # ------------------------------------------------------------ stage answers
    def launch(self, u: FlatUnit) -> None:
        super().launch(u)
        self._free(u)

    def after_backward(self) -> None:
        for u in self.units:
            self._free(u)
        self._bw_gathered = [False] * len(self.units)

    def publish(self, u: FlatUnit) -> None:
        shard = self.shard_param[u.index]
        self._write_master_into(u, shard)
        if self._persistent[u.index]:
            self.enqueue(self.comm.all_gather(u.flat, shard, async_op=True))

    def param_tensors(self) -> list[Tensor]:
        return list(self.shard_param) + [u.flat for u in self.units if u.is_allocated()]

    def gathered_bytes(self) -> int:
        return sum(u.flat.untyped_storage().nbytes() for u in self.units
                   if not self._persistent[u.index])
