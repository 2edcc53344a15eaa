"""ZeRO-Infinity: ZeRO-3's parameter shards and the optimizer's states in an offload tier.

Two parts, each over a `Tier` (zero/tier.py):

- `ParamTier` (`zero.offload_param`): each unit's parameter shard lives in the tier
  between uses. Before a unit's gather the shard is made ready (its load was started
  `zero.offload_prefetch` units earlier, so it ran while those units computed), the
  gather reads it, and the shard's memory is released at once — it is clean, the tier
  holds the same bytes. After the optimizer step the new shard is written whole into
  fresh memory (no read) and written back behind the next units' updates.
- `Streamed` (`zero.offload_optimizer: nvme`): an updater that steps unit by unit with
  each unit's master weights and optimizer moments in the tier: the units ahead are
  read while one updates (read-ahead of `offload_prefetch` units; 1: double
  buffering; 0: each read waited for), and each updated unit is written back while the
  next updates (write behind); at most prefetch + 2 units' states are in memory at once.
  On a CPU the gradient shards live in the tier too (`TierGrads`); on a GPU they stay
  in host memory, as with ZeRO-Offload.

Persistent units (under `zero.param_persistence_threshold`) keep their shard: it is a
view of their gathered buffer. Checkpoints see the same tensors as without a tier
(read one at a time through `zero.lazy`), so the format is tier-independent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim import foreach
from zerotrain.zero.grads import FullGrads, ShardedGrads
from zerotrain.zero.offload import HostOffload
from zerotrain.zero.tier import Placed, Tier
from zerotrain.zero.update import UnitByUnit, Views

#: the most optimizer state per parameter among zerotrain's elementwise rules, in units
#: of the fp32 master (RMSprop centered with momentum: 12 bytes): the disk reserved
STATE_PER_MASTER = 3


class ParamTier:
    """Where ZeRO-3's parameter shards live between uses (see the module docstring)."""

    def __init__(self, tier: Tier, depth: int):
        self.tier, self.depth = tier, depth
        self.placed: dict[int, Placed] = {}
        self.writing: list[Placed] = []  # shards written back, oldest first
        # (unit index, IOHandle) since the last step (bounded: evaluation has no step)
        self.loads: deque[tuple[int, Any]] = deque(maxlen=4096)

    @property
    def moves(self) -> bool:
        return self.tier.moves

    def place(self, u: Any) -> None:
        """A unit just built: its shard to the tier (so at most one unit's shard is ever
        in memory at init)."""
        if self.tier.moves and not u.persistent:
            p = self.placed[u.index] = Placed(self.tier, f"unit{u.index}.shard", u.shard)
            p.evict()
            p.settle()

    def fetch(self, u: Any) -> None:
        p = self.placed.get(u.index) if u is not None else None
        if p is not None and not p.resident:
            p.fetch()
            if p.loading is not None:
                self.loads.append((u.index, p.loading))

    def ready(self, u: Any) -> None:
        p = self.placed.get(u.index)
        if p is not None:
            self.fetch(u)
            p.ready()

    def release(self, u: Any) -> None:
        """The gather has read the shard: drop it (clean, so no write)."""
        p = self.placed.get(u.index)
        if p is not None:
            p.evict()
            p.settle()

    def overwrite(self, u: Any) -> None:
        """Memory for a shard about to be written whole (the publish): no read."""
        p = self.placed.get(u.index)
        if p is not None:
            p.settle()
            p.claim()

    def written(self, u: Any) -> None:
        """The publish wrote the shard: send it back (write behind; a shard's memory is
        released once `depth` (at least one) newer writes have started)."""
        p = self.placed.get(u.index)
        if p is not None:
            p.evict()
            self.writing.append(p)
            while len(self.writing) > max(1, self.depth):
                self.writing.pop(0).settle()

    def settle_all(self) -> None:
        for p in self.writing:
            p.settle()
        self.writing.clear()
        self.loads.clear()


class Tiers:
    """ZeRO-Infinity's parts while the units are built (zero/build.py): the disk is
    reserved once the cut is known, and each unit's shard and master go to their tier as
    soon as the unit exists, so init never holds more than one unit."""

    def __init__(self, params: ParamTier | None, opt: Tier | None):
        self.params = params or ParamTier(Tier(), 0)
        self.opt = opt
        self.masters: dict[int, Placed] = {}
        self.share = False  # the shard is the master (set by zero/build.py: `shares`)

    def shares(self, has_master: bool) -> bool:
        """Whether the parameter shard can be its own master: no separate master in the
        precision (fp32, bf16-pure) and shards and optimizer in one tier — then the
        shard is read with the moments and written back once, as the parameters."""
        self.share = not has_master and self.opt is not None and self.params.tier is self.opt
        return self.share

    @property
    def moves(self) -> bool:
        """Whether the units' shards or masters leave memory (then a master is never the
        shard itself)."""
        return self.params.moves or self.opt is not None

    def reserve(self, units: Sequence[Any], threshold: int, param_bytes: int,
                master_bytes: int) -> None:
        """Refuse, before anything is written, a disk that cannot hold the run's files
        (bytes per element of a shard and of a master; moments at most STATE_PER_MASTER
        masters)."""
        need: dict[int, tuple[Tier, int]] = {}

        def add(tier: Tier, n: int) -> None:
            need[id(tier)] = (tier, need.get(id(tier), (tier, 0))[1] + n)

        for u in units:
            if self.params.moves and u.numel >= threshold:
                add(self.params.tier, _aligned(u.shard_numel * param_bytes))
            if self.opt is not None:
                masters = STATE_PER_MASTER + (0 if self.share else 1)
                add(self.opt, _aligned(u.shard_numel * master_bytes) * masters)
        for tier, n in need.values():
            tier.require(n)

    def place(self, u: Any) -> None:
        self.params.place(u)
        if self.opt is None:
            return
        if u.master is u.shard:  # shared: one placed tensor (a persistent unit's stays)
            if u.index in self.params.placed:
                self.masters[u.index] = self.params.placed[u.index]
            return
        p = self.masters[u.index] = Placed(self.opt, f"unit{u.index}.master", u.master)
        p.evict()
        p.settle()


def _aligned(n: int) -> int:
    return -(-n // 4096) * 4096


class TierGrads(ShardedGrads):
    """ZeRO-3's gradient shards in the optimizer's tier (`offload_optimizer: nvme` on a
    CPU): each reduced shard is written behind the backward and read back with its
    unit's master and moments for the update, so no gradient stays in memory.

    The first landing of a step writes the shard whole into fresh memory (no read); an
    accumulating one reads it back and adds. The squared-norm's per-unit fp32 norms are
    taken as each shard lands (the last micro-step's stay), and the clipping factor is
    applied when the shard is read for the update: the global norm and the update are
    those `foreach.sum_of_squares` and `scale_` give on resident shards, bit for bit.
    """

    def __init__(self, *args, tier: Tier, depth: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tier, self.depth = tier, max(1, depth)
        self.placed: dict[int, Placed] = {}
        self.norms: dict[int, Tensor] = {}
        self.factors: list[float] = []  # scale_grads since the backward, applied on read
        self.writing: list[Placed] = []

    def allocate(self, u: Any) -> None:
        super().allocate(u)
        p = self.placed[u.index] = Placed(self.tier, f"unit{u.index}.grad", u.grad)
        p.drop()

    def landing(self, u: Any):
        p = self.placed[u.index]
        if u.grad_dirty:
            p.ready()  # accumulation: the shard so far
        else:
            p.claim()
        out, done = super().landing(u)

        def finish() -> None:
            done()
            self.norms[u.index] = torch._foreach_norm([u.grad], 2, dtype=torch.float32)[0]
            p.dirty = True
            p.evict()
            self.writing.append(p)
            while len(self.writing) > self.depth:
                self.writing.pop(0).settle()
        return out, finish

    def drain(self) -> None:
        super().drain()
        for p in self.writing:
            p.settle()
        self.writing.clear()

    def norm_sq(self, units: Sequence[Any], device: torch.device) -> Tensor:
        """Σ‖shard‖² as `foreach.sum_of_squares` over the units' shards gives it."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        return total + torch.stack([self.norms[u.index] for u in units]).double().square().sum()

    def scale(self, factor: float) -> None:
        self.factors.append(factor)

    def apply_scale(self, u: Any) -> None:
        for f in self.factors:
            foreach.scale_([u.grad], f)

    def clear(self, units: list[Any]) -> None:
        super().clear(units)
        self.norms.clear()
        self.factors.clear()


class NvmeOffload(HostOffload):
    """The placement of `zero.offload_optimizer: nvme` (zero/placement.py): ZeRO-Offload's,
    with masters and moments — and on a CPU the gradient shards (`TierGrads`) — in the
    NVMe tier between uses, streamed by the `Streamed` updater. Masters are plain host
    memory, resizable (a pinned buffer's size is fixed): a GPU's publish copies from
    pageable memory. `tier` and `depth` are set by `zero.build_strategy`."""

    suffix = "-nvme"  # zero3-nvme: the strategy's name in logs and memory reports

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.steps_by_unit = True
        self.tier: Tier = Tier()
        self.depth = 1

    def make_grads(self, stage: Any, policy: PrecisionPolicy, in_flight: int) -> FullGrads:
        if self.gpu:  # the shards stay in (pinned) host memory, as with ZeRO-Offload
            return super().make_grads(stage, policy, in_flight)
        self.grads = TierGrads(policy.grad_dtype, self.device, self.host,
                               **stage.grads_options(policy, in_flight), tier=self.tier,
                               depth=self.depth)
        return self.grads

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.host)


class Streamed(UnitByUnit):
    """The optimizer step with masters and moments streamed from a tier, unit by unit."""

    def __init__(self, strategy: Any):
        super().__init__(strategy)
        s = strategy
        assert s.tiers.opt is not None
        self.tier: Tier = s.tiers.opt
        self.depth = s.cfg.offload_prefetch
        self.masters: dict[int, Placed] = s.tiers.masters  # placed while the units were built
        self.states: dict[tuple[int, int, str], Placed] = {}  # (unit, view #, name)

    def views(self) -> Views:
        """The optimizer's views of the masters, which are in their tier: each storage is
        given its size back for the slicing (allocated, never touched: no memory is used)
        and released again; the views stay valid, refilled in place by every fetch."""
        away = [p for p in self.masters.values() if not p.resident]
        for p in away:
            p.t.untyped_storage().resize_(p.t.numel() * p.t.element_size())
        out = super().views()
        for p in away:
            p.t.untyped_storage().resize_(0)
        return out

    def describe(self) -> str | None:
        return (f"optimizer states streamed from the {self.tier.kind} tier unit by unit "
                f"({self.depth} unit(s) read ahead, written behind)")

    # ------------------------------------------------------------ residency
    def _placed(self, u: Any) -> list[Placed]:
        own = [self.masters[u.index]] if u.index in self.masters else []
        return own + [p for (i, _, _), p in self.states.items() if i == u.index]

    def _grad(self, u: Any) -> Placed | None:
        g = self.s.grads
        return g.placed.get(u.index) if isinstance(g, TierGrads) else None

    def _bind_states(self, u: Any, views: Views) -> None:
        """Track the optimizer's tensors of `u`'s views (made at their first step, or
        replaced by a checkpoint load) as placed tensors that own their storage."""
        opt = self.s._optimizer
        for j, (_, view) in enumerate(views):
            for name, t in list(opt.state.get(view, {}).items()):
                size = t.numel() if isinstance(t, Tensor) else 0  # int8: + block scales
                if size <= 1 or (size != view.numel() and not name.endswith("~scale")):
                    continue
                key = (u.index, j, name)
                p = self.states.get(key)
                if p is not None and p.t is t:
                    continue
                st = t.untyped_storage()  # a loaded checkpoint's: a view, or not resizable
                if t.storage_offset() or st.nbytes() != t.nbytes or not st.resizable():
                    t = t.clone()
                    opt.state[view][name] = t
                if p is None:
                    self.states[key] = Placed(self.tier, f"unit{u.index}.{j}.{name}", t)
                else:  # same home in the tier, new tensor
                    p.t, p.resident, p.dirty = t, True, True

    def fetch(self, u: Any, grad: bool = False) -> None:
        g = self._grad(u) if grad else None
        for p in self._placed(u) + ([g] if g is not None else []):
            p.fetch()

    def ready(self, u: Any, grad: bool = False) -> None:
        g = self._grad(u) if grad else None
        for p in self._placed(u) + ([g] if g is not None else []):
            p.ready()
        if g is not None:
            self.s.grads.apply_scale(u)

    def evict(self, u: Any) -> None:
        for p in self._placed(u):
            p.dirty = True
            p.evict()
        g = self._grad(u)
        if g is not None:
            g.drop()  # used: the next backward's first landing writes it whole

    def settle(self, u: Any) -> None:
        self.s.fence_master(u)  # an asynchronous publish (GPU) has read the master
        for p in self._placed(u):
            p.settle()

    def placed_all(self) -> list[Placed]:
        """Every master and moment kept in the tier (the optimizer's new tensors bound)."""
        s, by_unit = self.s, self._by_unit()
        for u in s.units:
            if u.index in by_unit and getattr(s, "_optimizer", None) is not None:
                self._bind_states(u, by_unit[u.index])
        return [p for u in s.units for p in self._placed(u)]

    def resident(self) -> None:
        """Everything in memory (a load of weights from another source): the next step
        sends it back. A checkpoint reads them one at a time instead (`lazy_states`)."""
        self.placed_all()
        for u in self.s.units:
            self.fetch(u)
        for u in self.s.units:
            self.ready(u)
            for p in self._placed(u):
                p.dirty = True

    def _by_unit(self) -> dict[int, Views]:
        by_unit: dict[int, Views] = {}
        for seg, view in self.s.opt_segments:
            by_unit.setdefault(seg.unit, []).append((seg, view))
        return by_unit

    # ------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        s = self.s
        s._optimizer = optimizer
        by_unit = self._by_unit()
        order = list(s.units)
        for u in order:  # states replaced by a load since the last step
            if u.index in by_unit:
                self._bind_states(u, by_unit[u.index])
        for u in order[:self.depth]:
            self.fetch(u, grad=True)
        for k, u in enumerate(order):
            if k + self.depth < len(order):
                self.fetch(order[k + self.depth], grad=True)  # read ahead
            self.ready(u, grad=True)
            if u.index in by_unit:
                s.attach_grads(by_unit[u.index])
                optimizer.step()
                s.detach_grads()
                self._bind_states(u, by_unit[u.index])  # first step: new moments
            s.publish(u)
            self.evict(u)  # write behind
            if k >= 1:
                self.settle(order[k - 1])
        for u in order[-1:]:
            self.settle(u)
