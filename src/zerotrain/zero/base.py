"""The Strategy interface and the machinery every ZeRO stage shares.

A strategy owns the model states (parameters, gradients, master weights) laid out in
units, decides what each rank keeps, and talks to the other ranks through `Comm`. The
engine only calls:

    pre_backward(boundary) -> [autograd runs; our hooks fire] -> finish_backward()
    grad_norm_sq() -> scale_grads(f) -> optimizer_step(optimizer) -> after_step()
    -> zero_grad()

A strategy is composed from parts chosen once by `zero.build_strategy`: the `Partition`
its units are cut across (zero/partition.py), the placement (zero/states/home.py: on the
device, ZeRO-Offload's host memory, or the disk) which makes the gradient store
(`grads_class`, zero/states/grads.py) and the masters, the parameters' wire
(zero/params/wire.py), where first values come from (zero/init.py) and the updater
(zero/update.py: elementwise, unit by unit, or Muon's matrix owners). None of them is a
flag the strategy branches on.

Each stage file is a small subclass declaring what it shards (`shards`) and answering
three questions — how parameters are cut into units (`cut`), what to send when a
unit's gradients are complete (`reduce_grads`), and how updated weights get back to
every rank (`publish`). Hooks and norms live here, once; checkpoint state in
`zero/state.py`, the memory audit in `zero/audit.py`; the units arrive finished from
`zero/build.py`.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.comm.collectives import Handle
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero import experts
from zerotrain.zero.cut import UnitSpec, buckets
from zerotrain.zero.flat import NamedParams, Segment
from zerotrain.zero.params.wire import PlainWire
from zerotrain.zero.partition import Partition
from zerotrain.zero.state import StrategyState
from zerotrain.zero.states.grad_wire import PlainGradWire
from zerotrain.zero.states.grads import FullGrads
from zerotrain.zero.states.home import Kind, OnDevice, Placement
from zerotrain.zero.unit import Unit
from zerotrain.zero.update import Elementwise, Updater


class Strategy(StrategyState):
    name = "ddp"
    stage = 0
    shards: frozenset[str] = frozenset()    # model states kept 1/N (of memory.FIELDS)
    grads_class: type[FullGrads] = FullGrads
    unit_class: type[Unit] = Unit

    def __init__(self, model: nn.Module, plan: Plan, policy: PrecisionPolicy, part: Partition,
                 cfg: ZeroConfig, device: torch.device, units: list[Unit], grads: FullGrads,
                 *, updater: type[Updater] = Elementwise, wire: PlainWire | None = None,
                 placement: Placement | None = None, grad_wire: PlainGradWire | None = None):
        """Finished `units` and their gradient store `grads` (zero/build.py makes both),
        and the parts `zero.build_strategy` chose: `updater`, how the optimizer meets the
        master weights; `wire`, how gathered parameters travel (ZeRO-3); `grad_wire`, how
        the gradient reduce-scatter travels (ZeRO++'s qgZ, zero/states/grad_wire.py); `placement`,
        where gradients, masters and optimizer states live (the one that made `grads`)."""
        assert part.comm is not None, "a strategy talks to its partition's ranks"
        self.placement = placement or OnDevice(device)
        self.name = type(self).name + self.placement.suffix  # "zero2-offload"
        self.model, self.plan, self.policy, self.cfg = model, plan, policy, cfg
        self.part, self.comm = part, part.comm
        self.max_in_flight = cfg.in_flight(device.type)  # reductions running in backward
        self.wire = wire or PlainWire()
        self.grad_wire = grad_wire or PlainGradWire()
        self.device = device
        self.host = grads.host
        self.rank, self.world = part.rank, part.world
        self.grads, self.units = grads, units
        self.updater = updater(self)
        self.opt_segments: list[tuple[Segment, Tensor]] = self.updater.views()
        self.placement.attach(units, self.opt_segments)
        self._pending: list[tuple[Handle, Callable[[], None] | None]] = []
        self._communicate = True
        self._callback_queued = False
        self._open = False
        self._summed = False  # stages 0–1: the full gradients hold the ranks' sum
        for u in self.units:
            for i, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(self._hook(u, i))
        self._follow_zero_grad(model)

    # ================================================================ declarations
    @property
    def shards_optimizer(self) -> bool:  # ZeRO-1+: master weights and optimizer states 1/N
        return "optimizer" in self.shards

    @property
    def shards_params(self) -> bool:  # ZeRO-3: parameters are 1/N between uses
        return "params" in self.shards

    @property
    def kind(self) -> Kind:  # what `zero.run_shape` reads: the stage class and placement
        return Kind(type(self), type(self.placement))

    @property
    def offloads(self) -> frozenset[str]:  # model states kept off the device (the placement)
        return self.placement.offloads

    @property
    def offload(self) -> bool:  # Offload: master, gradient shard, optimizer states on host
        return bool(self.offloads)

    def describe(self) -> list[str]:
        """Lines for the run's start about how this strategy was composed (empty: nothing
        beyond the config to say)."""
        lines = [self.updater.describe(), self.placement.describe()]
        return [line for line in lines if line] + [
            line for t in self.moving_tiers() for line in t.describe()]

    # ================================================================ tiers (ZeRO-Infinity)
    def moving_tiers(self) -> list[Any]:
        """The tiers that really move bytes (each once: parts may share one)."""
        found = self.param_tiers() + self.placement.moving_tiers()
        return list({id(t): t for t in found}.values())

    def param_tiers(self) -> list[Any]:
        """The tiers parameter shards live in between uses (ZeRO-3's store; none here)."""
        return []

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each tier read and wrote since the last call (the engine's step)."""
        return {t.kind: t.counter.take() for t in self.moving_tiers()}

    def fill_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer's load: moments read from a checkpoint go to their home."""
        self.placement.use(optimizer)
        self.placement.fill_optimizer()

    # ================================================================ stage questions
    @classmethod
    def cut(cls, model: nn.Module, plan: Plan, named: NamedParams, cfg: ZeroConfig,
            policy: PrecisionPolicy) -> list[UnitSpec]:
        """How parameters become units (zero/cut.py): stages 0–2, size-bounded buckets."""
        return buckets(named, cfg, policy)

    @classmethod
    def grads_options(cls, policy: PrecisionPolicy, in_flight: int) -> dict:
        """Extra arguments of `grads_class` (ZeRO-2+: its bucket dtype and pool)."""
        return {}

    def reduce_grads(self, u: Unit) -> None:
        """The unit's gradients are complete on this rank: start their reduction."""
        raise NotImplementedError

    def publish(self, u: Unit) -> None:
        """After the update: make every rank's parameters equal the new master weights."""
        lo, hi = self.opt_range(u)
        self.write_master_into(u, u.params[lo:hi])

    # ================================================================ layout
    def opt_range(self, u: Unit) -> tuple[int, int]:
        """The slice of the unit's flat coordinates this rank's optimizer updates."""
        return u.shard_range if self.shards_optimizer else (0, u.padded_numel)

    def fence_master(self, u: Unit) -> None:
        """Before the host writes `u.master` (or what its publish reads): wait for the
        last asynchronous publish of `u` to have read it (the placement's fence)."""
        self.placement.fence(u)

    def write_master_into(self, u: Unit, dst: Tensor) -> None:
        self.placement.write_master(u, dst)

    def param_groups(self, options: dict[int, dict]) -> list[dict]:
        """Optimizer groups over the master views, with each group id's hyper-parameters."""
        groups: dict[int, list[Tensor]] = {}
        for seg, view in self.opt_segments:
            groups.setdefault(seg.group, []).append(view)
        out = [{"params": ps, **options[g], "group_id": g} for g, ps in sorted(groups.items())]
        return self.updater.param_groups(out, options)

    # ================================================================ gradient hooks
    def _hook(self, u: Unit, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._on_grad(u, i)
        return hook

    def _on_grad(self, u: Unit, i: int) -> None:
        if not self._open:  # a backward this engine did not start: another engine's loss
            self.pre_backward(True)  # through this model (a GAN's G through D): reduced
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        slot = u.slots[i]
        g = slot.param.grad
        dst = u.view_of(self.grads.target(u), slot)
        if g is not None and g.data_ptr() != dst.data_ptr():
            dst.add_(g.view(slot.shape))
            # from now on autograd accumulates in place into the buffer (dtypes allowing)
            slot.param.grad = dst if dst.dtype == g.dtype else None
        u.ready.add(i)
        if (self._communicate and self.cfg.overlap and not u.reduced
                and len(u.ready) == len(u.slots)):
            u.reduced = True
            self.reduce_grads(u)

    # ================================================================ engine calls
    def pre_backward(self, boundary: bool) -> None:
        """Called before each backward; on non-boundary micro-steps stages 0–1 stay quiet."""
        self._communicate = boundary or self.grads.every_micro_step
        self._callback_queued = False
        self._open = True
        self._unsum()

    def _unsum(self) -> None:
        """Several backwards before one step (stages 0–1): a reduction left the ranks' sum
        in every rank's full gradient (ZeRO-1: in its own chunk); reduced again with the
        next backward's it would count N times. Each rank keeps only its own chunk of it,
        so the next sum over ranks counts it once: g1 + g2, as one process has it."""
        if not self._summed:
            return
        self._summed = False
        with torch.no_grad():
            for u in self.units:
                lo, hi = u.shard_range
                u.grad[:lo].zero_()
                u.grad[hi:].zero_()

    def finish_backward(self) -> None:
        """End of backward (autograd callback): reduce late units, wait for all traffic."""
        if not self._open:  # already finished by the autograd callback
            return
        self._open = False
        if self._communicate:
            # Units not reduced yet (overlap off, or parameters that got no gradient) go
            # now, in unit order; every rank does the same, so the collectives pair up.
            for u in self.units:
                if not u.reduced:
                    u.reduced = True
                    self.reduce_grads(u)
        self.wait_pending()
        self.grads.drain()
        self._summed = self._communicate and not self.grads.every_micro_step
        for u in self.units:
            u.end_backward()
        self._callback_queued = False
        self.after_backward()

    def after_backward(self) -> None:
        pass

    def enqueue(self, handle: Handle, post: Callable[[], None] | None = None) -> None:
        """Track an in-flight collective; retire the oldest when too many are in flight,
        so transient buckets are freed during backward instead of piling up."""
        self._pending.append((handle, post))
        while len(self._pending) > self.max_in_flight:
            h, p = self._pending.pop(0)
            h.wait()
            if p is not None:
                p()

    def wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for handle, post in pending:
            handle.wait()
            if post is not None:
                post()

    def owned_grad(self, u: Unit) -> Tensor:
        """Gradient covering `opt_range(u)`, in the coordinates of `u.master`."""
        return self.grads.owned(u, *self.opt_range(u))

    def _owned_grads(self) -> list[Tensor]:
        return [self.owned_grad(u) for u in self.units]

    def grad_norm_sq(self) -> float:
        """Squared global L2 norm of the (still scaled) gradient, identical on every rank."""
        ep = experts.grad_norm_sq(self)  # expert units: sharded over their own ranks
        if ep is not None:
            return ep
        local = self.grads.norm_sq(self.units, self._owned_grads, self.host)
        if self.shards_optimizer:
            local = self.comm.all_reduce_scalars(local.reshape(1))[0]
        return float(local)

    def scale_grads(self, factor: float) -> None:
        self.grads.scale(self._owned_grads, factor)

    def attach_grads(self, segments: list[tuple[Segment, Tensor]] | None = None) -> None:
        """Point each optimizer tensor's .grad (of `segments`, default all) at its slice of
        the owned gradient. Before the CPU writes these units' masters, their last
        publish has read them (the placement's fence; distributed Muon writes matrix
        slices later, fenced in `MatrixOwners.apply`)."""
        segments = self.opt_segments if segments is None else segments
        for i in {seg.unit for seg, _ in segments}:
            self.fence_master(self.units[i])
        grads = {}
        for seg, view in segments:
            u = self.units[seg.unit]
            if u.index not in grads:
                g = self.owned_grad(u)
                # a compact update reads any dtype (and fp32 grads beat bf16 ones there)
                cast = g.dtype != view.dtype and not self.policy.compact.active
                grads[u.index] = g.to(view.dtype) if cast else g
            lo = self.opt_range(u)[0]
            if grads[u.index].dtype != view.dtype:
                view.grad_dtype = None  # torch ≥ 2.10: a gradient of another dtype
            view.grad = grads[u.index][seg.start - lo:seg.end - lo].view(view.shape)

    def detach_grads(self) -> None:
        for _, view in self.opt_segments:
            view.grad = None

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Update the master weights from the owned (unscaled, clipped) gradients, the
        updater's way (zero/update.py).

        The optimizer's first-step hook (the compile vote, a collective) runs here first,
        on every rank: inside the first `optimizer.step()` it would come after unit 0's
        publish on a rank whose share of unit 0 is all padding (no step for it, unit by
        unit) and before it on the others — collectives in different orders, a hang on
        NCCL."""
        hook = getattr(optimizer, "before_first_step", None)
        if hook is not None:
            optimizer.before_first_step = None
            hook()
        self.placement.use(optimizer)
        self.updater.step(optimizer)

    def after_step(self) -> None:
        if not self.updater.publishes:  # else: published unit by unit in the step
            for u in self.units:
                self.publish(u)
        self.wait_pending()
        self.after_publish()

    def after_publish(self) -> None:
        """Every rank holds the new weights: the wire re-packs what gathers send."""
        self.wire.refresh(self.units, self.comm)

    def zero_grad(self) -> None:
        self.grads.clear(self.units)
        self._summed = False

    def _follow_zero_grad(self, model: nn.Module) -> None:
        """`model.zero_grad()` clears the gradients kept here too, as it clears .grad in
        plain torch: another engine's backward through this model (a GAN's) leaves its
        gradient in them, which the user's zero_grad must drop. Bound to the model and
        holding this strategy weakly: a deep copy (an EMA) clears only its own, and a
        later engine over the same model replaces this one."""
        model._zerotrain_grads = weakref.ref(self)
        model.zero_grad = types.MethodType(_zero_grad, model)  # type: ignore[method-assign]

    @contextmanager
    def full_parameters(self, params: Any = None) -> Iterator[None]:
        """Every parameter (or `params`) usable in full inside the block (ZeRO-3 gathers;
        collective)."""
        yield

    def close(self) -> None:
        try:
            self.placement.close()
            self.comm.close()
        finally:
            for t in self.moving_tiers():
                t.close()


def _zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    """A model's zero_grad while an engine trains it (`Strategy._follow_zero_grad`)."""
    type(module).zero_grad(module, set_to_none)
    ref = module.__dict__.get("_zerotrain_grads")
    strategy = ref() if ref is not None else None
    if strategy is not None and strategy.model is module:
        strategy.zero_grad()
