"""ZeRO-Infinity's disk home: masters and optimizer moments (and on a CPU the gradient
shards) in the NVMe tier between uses (`zero.offload_optimizer: nvme`).

The optimizer steps unit by unit (zero/update.py `UnitByUnit`) through this home's
residency hooks: the units ahead are read while one updates (read-ahead of
`offload_prefetch` units; 1: double buffering; 0: each read waited for), and each
updated unit is written back while the next updates (write behind); at most prefetch + 2
units' states are in memory at once. On a CPU the gradient shards live in the tier too
(`TierGrads`); on a GPU they stay in host memory, as with ZeRO-Offload. Checkpoints see
the same tensors as without a tier (read one at a time through `tiers.lazy`), so the
format is tier-independent.

`Tiers` is the build's record of ZeRO-Infinity's parts: the parameter tier
(zero/params/tiered.py) and this home's tier, the disk reserved once for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from zerotrain.config import ZeroConfig
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim import foreach
from zerotrain.optim.compact import convert_state
from zerotrain.zero.params.tiered import ParamTier
from zerotrain.zero.states.grads import FullGrads, ShardedGrads
from zerotrain.zero.states.host import HostOffload
from zerotrain.zero.tiers.io import ALIGN, aligned
from zerotrain.zero.tiers.lazy import Lazy, from_tier
from zerotrain.zero.tiers.placed import Placed
from zerotrain.zero.tiers.tier import Tier

#: the most optimizer state per parameter among zerotrain's elementwise rules, in units
#: of the fp32 master (RMSprop centered with momentum: 12 bytes): the disk reserved
STATE_PER_MASTER = 3


def io_bytes(z: ZeroConfig) -> int:
    """The disk tier's block-I/O buffers: one block per I/O thread (tiers/io.BlockIO's
    page-aligned bounce buffer; buffered I/O, nvme_direct false, needs none)."""
    return 0 if z.nvme_direct is False else z.nvme_threads * max(
        ALIGN, aligned(int(z.nvme_block_mb * 2**20)))


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

    def norm_sq(self, units: Sequence[Any], owned: Callable[[], list[Tensor]],
                device: torch.device) -> Tensor:
        """Σ‖shard‖² as `foreach.sum_of_squares` over the units' shards gives it, from the
        norms taken as each shard landed (the shards are in the tier)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        return total + torch.stack([self.norms[u.index] for u in units]).double().square().sum()

    def scale(self, owned: Callable[[], list[Tensor]], factor: float) -> None:
        self.factors.append(factor)  # applied as each shard is read back (`apply_scale`)

    def apply_scale(self, u: Any) -> None:
        for f in self.factors:
            foreach.scale_([u.grad], f)

    def clear(self, units: list[Any]) -> None:
        super().clear(units)
        self.norms.clear()
        self.factors.clear()


class NvmeOffload(HostOffload):
    """The disk home (the module docstring): ZeRO-Offload's, with masters and moments —
    and on a CPU the gradient shards (`TierGrads`) — in the NVMe tier between uses.
    Masters are plain host memory, resizable (a pinned buffer's size is fixed): a GPU's
    publish copies from pageable memory."""

    suffix = "-nvme"  # zero3-nvme: the strategy's name in logs and memory reports

    def __init__(self, device: torch.device, tiers: Tiers | None = None, depth: int = 1):
        super().__init__(device)
        self.steps_by_unit = True
        self.tier: Tier = tiers.opt if tiers is not None and tiers.opt is not None else Tier()
        self.depth = depth
        #: placed while the units were built (zero/build.py through `Tiers.place`)
        self.masters: dict[int, Placed] = tiers.masters if tiers is not None else {}
        self.states: dict[tuple[int, int, str], Placed] = {}  # (unit, view #, name)
        self.tier_grads: TierGrads | None = None

    @classmethod
    def make(cls, device: torch.device, tiers: Any = None, depth: int = 1) -> NvmeOffload:
        return cls(device, tiers, depth)

    def make_grads(self, stage: Any, policy: PrecisionPolicy, in_flight: int) -> FullGrads:
        if self.gpu:  # the shards stay in (pinned) host memory, as with ZeRO-Offload
            return super().make_grads(stage, policy, in_flight)
        self.grads = self.tier_grads = TierGrads(
            policy.grad_dtype, self.device, self.host, **stage.grads_options(policy, in_flight),
            tier=self.tier, depth=self.depth)
        return self.grads

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.host)

    def moving_tiers(self) -> list[Tier]:
        return [self.tier] if self.tier.moves else []

    def describe(self) -> str | None:
        return (f"optimizer states streamed from the {self.tier.kind} tier unit by unit "
                f"({self.depth} unit(s) read ahead, written behind)")

    @contextmanager
    def sized(self) -> Iterator[None]:
        """Each master away in the tier is given its storage's size back while the
        optimizer's views are cut (allocated, never touched: no memory is used) and
        released again; the views stay valid, refilled in place by every fetch."""
        away = [p for p in self.masters.values() if not p.resident]
        for p in away:
            p.t.untyped_storage().resize_(p.t.numel() * p.t.element_size())
        try:
            yield
        finally:
            for p in away:
                p.t.untyped_storage().resize_(0)

    # ------------------------------------------------------------ residency
    def _placed(self, u: Any) -> list[Placed]:
        own = [self.masters[u.index]] if u.index in self.masters else []
        return own + [p for (i, _, _), p in self.states.items() if i == u.index]

    def _grad(self, u: Any) -> Placed | None:
        g = self.tier_grads
        return g.placed.get(u.index) if g is not None else None

    def bind(self, u: Any) -> None:
        """Track the optimizer's tensors of `u`'s views (made at their first step, or
        replaced by a checkpoint load) as placed tensors that own their storage."""
        opt = self.optimizer
        if opt is None:
            return
        for j, (_, view) in enumerate(self.by_unit.get(u.index, ())):
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
        if g is not None and self.tier_grads is not None:
            self.tier_grads.apply_scale(u)

    def claim(self, u: Any) -> None:
        p = self.masters.get(u.index)
        if p is not None:
            p.claim()

    def evict(self, u: Any) -> None:
        for p in self._placed(u):
            p.dirty = True
            p.evict()
        g = self._grad(u)
        if g is not None:
            g.drop()  # used: the next backward's first landing writes it whole

    def settle(self, u: Any) -> None:
        self.fence(u)  # an asynchronous publish (GPU) has read the master
        for p in self._placed(u):
            p.settle()

    def placed_all(self) -> list[Placed]:
        """Every master and moment kept in the tier (the optimizer's new tensors bound)."""
        for u in self.units:
            self.bind(u)
        return [p for u in self.units for p in self._placed(u)]

    def lazy_states(self) -> dict[int, Lazy]:
        return {id(p.t): from_tier(p) for p in self.placed_all() if p.moves}

    def resident(self) -> None:
        """Everything in memory: the next step sends it back. A checkpoint reads them one
        at a time instead (`lazy_states`)."""
        self.placed_all()
        for u in self.units:
            self.fetch(u)
        for u in self.units:
            self.ready(u)
            for p in self._placed(u):
                p.dirty = True

    def fill_optimizer(self) -> None:
        """The optimizer's `Lazy` moments read one unit at a time, each bound to its home
        in the tier and sent back before the next."""
        opt = self.optimizer
        assert opt is not None
        compact = getattr(opt, "compact", None)  # compact states keep their dtypes
        keep = compact is not None and compact.active
        for u in self.units:
            for _, view in self.by_unit.get(u.index, ()):
                st = opt.state.get(view, {})
                for name, v in list(st.items()):
                    if isinstance(v, Lazy):
                        t = v.load().to(device=view.device)
                        cast = view.is_floating_point() and not keep
                        st[name] = t.to(view.dtype) if cast else t
                if keep and st:
                    convert_state(st, view, compact)
            self.bind(u)
            self.evict(u)
            self.settle(u)
