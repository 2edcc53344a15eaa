"""The Strategy interface and the machinery every ZeRO stage shares.

A strategy owns the model states (parameters, gradients, master weights) laid out in
units, decides what each rank keeps, and talks to the other ranks through `Comm`. The
engine only calls:

    pre_backward(boundary) -> [autograd runs; our hooks fire] -> finish_backward()
    grad_norm_sq() -> scale_grads(f) -> optimizer_step(optimizer) -> after_step()
    -> zero_grad()

(`optimizer_step` is attach_grads → optimizer.step → detach_grads, plus distributed
Muon's matrix exchange when the stage shards a non-elementwise optimizer: zero/muon.py.)

Each stage file is a small subclass answering three questions — how parameters are cut
into units (`make_units`), what to send when a unit's gradients are complete
(`reduce_grads`), and how updated weights get back to every rank (`publish`) — and
naming where gradients live (`grads_class`). Hooks, optimizer views, norms live here,
once; the audit and checkpoint state in `zero/state.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.config import ZeroConfig
from zerotrain.models.plan import Plan
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.optim import foreach
from zerotrain.zero.flat import NamedParams, Segment, bucket_params
from zerotrain.zero.grads import FullGrads
from zerotrain.zero.muon import MuonOwners
from zerotrain.zero.state import StrategyState
from zerotrain.zero.unit import Unit


class Strategy(StrategyState):
    name = "ddp"
    stage = 0
    shards_optimizer = False  # ZeRO-1+: master weights and optimizer states are 1/N
    shards_params = False     # ZeRO-3: parameters are 1/N between uses
    offload = False           # Offload: master, gradient shard, optimizer states on host
    grads_class: type[FullGrads] = FullGrads
    unit_class: type[Unit] = Unit

    def __init__(self, model: nn.Module, plan: Plan, policy: PrecisionPolicy, comm: Comm,
                 cfg: ZeroConfig, device: torch.device, keep_shapes: bool = False,
                 skip_init: bool = False, fp8_gather: bool = False):
        """`keep_shapes`: hand the optimizer one tensor per parameter with its real shape
        (Muon needs matrices) instead of one flat run per (unit, group). `skip_init`:
        meta parameters are left at zero (pretrained weights are loaded next)."""
        self.model, self.plan, self.policy, self.comm, self.cfg = model, plan, policy, comm, cfg
        self.max_in_flight = cfg.in_flight(device.type)  # reductions running in backward
        self.keep_shapes, self.skip_init = keep_shapes, skip_init
        self.fp8_gather = fp8_gather  # ZeRO-3: gather the plan's FP8 weights in FP8
        self.device = device
        self.host = torch.device("cpu") if self.offload else device
        self.rank, self.world = comm.rank, comm.world_size
        named = [(n, p, int(plan.group_of(n))) for n, p in model.named_parameters()
                 if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        place_rest(model, device, policy.param_dtype, plan.init_buffers)
        self.grads = self.grads_class(policy.grad_dtype, device, self.host,
                                      **self.grads_options())
        # Offload on a GPU: publish each unit as soon as the CPU has updated it
        self.step_by_unit = self.offload and getattr(self.grads, "gpu", False)
        # GPUs want 16-byte aligned parameters and shards; the CPU packs them end to end
        align = 16 // policy.param_dtype.itemsize if device.type == "cuda" else 1
        self.units: list[Unit] = [
            self.unit_class.build(i, name, ps, self.world, self.rank, align, **extra)
            for i, (name, ps, extra) in enumerate(self.make_units(named))
        ]
        for u in self.units:
            self.init_unit(u)
        self.init_done()
        self.opt_segments: list[tuple[Segment, Tensor]] = self._optimizer_views()
        # Muon above stage 0: every matrix is updated whole by one owner (zero/muon.py)
        self.muon = MuonOwners(self) if keep_shapes and self.shards_optimizer else None
        if self.muon is not None:
            self.opt_segments = self.muon.optimizer_views(self.opt_segments)
        self._pending: list[tuple[Handle, Callable[[], None] | None]] = []
        self._communicate = True
        self._callback_queued = False
        self._open = False
        for u in self.units:
            for i, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(self._hook(u, i))

    # ================================================================ stage questions
    def make_units(self, named: NamedParams) -> list[tuple[str, NamedParams, dict]]:
        """Stages 0–2: size-bounded buckets in reverse order (gradient readiness order).
        Each entry: (unit name, its parameters, extra Unit fields)."""
        numel = max(1, int(self.cfg.bucket_mb * 2**20 / self.policy.reduce_dtype.itemsize))
        return [(f"bucket{i}", b, {}) for i, b in enumerate(bucket_params(named, numel))]

    def grads_options(self) -> dict:
        return {}

    def init_unit(self, u: Unit) -> None:
        """Move the unit's parameters into its flat buffer; give it gradients and master."""
        u.materialize(self.policy.param_dtype, self.device, self.init_values)
        self.grads.allocate(u)
        lo, hi = self.opt_range(u)
        u.master = self.master_for(u.params[lo:hi])

    def init_done(self) -> None:
        """Every unit is initialised (ZeRO-3 drops its scratch buffer here)."""

    def init_values(self, u: Unit) -> None:
        """Initial values of a unit built on the meta device, written into its buffer.

        The plan's rule (`Plan.init`: a function of seed and name, so the values equal
        the eagerly built model's), else each module's `reset_parameters()`. Skipped
        when pretrained weights will fill the unit anyway (`self.skip_init`).
        """
        if self.skip_init:
            return
        if self.plan.init is not None:
            for s in u.slots:
                self.plan.init(s.name, s.param.data)
            return
        mine = {id(s.param) for s in u.slots}
        for m in self.model.modules():
            if any(id(p) in mine for p in m.parameters(recurse=False)):
                reset = getattr(m, "reset_parameters", None)
                if reset is None:
                    raise ValueError(f"module {type(m).__name__} was built on the meta device "
                                     "but has no reset_parameters() and the model's plan "
                                     "gives no init rule; build it on a real device")
                reset()

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

    def master_for(self, own: Tensor) -> Tensor:
        """The optimizer's copy of the weights in `own`: a separate FP32 (or host) tensor
        in mixed precision or Offload; otherwise `own` itself — the parameters are their
        own master (fp32, bf16-pure)."""
        if self.policy.has_master or self.offload:
            master = self.host_zeros(own.numel(), self.policy.master_dtype or own.dtype)
            master.copy_(own)
            return master
        return own

    def host_zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Zeros where the optimizer's states live (the device, or the host under Offload)."""
        return torch.zeros(numel, dtype=dtype, device=self.host)

    def fence_master(self, u: Unit) -> None:
        """Before the host writes `u.master` (or what its publish reads): wait for the
        last asynchronous publish of `u` to have read it (Offload on a GPU; else nothing)."""

    def write_master_into(self, u: Unit, dst: Tensor) -> None:
        if u.master.data_ptr() != dst.data_ptr():
            dst.copy_(u.master, non_blocking=True)

    def _optimizer_views(self) -> list[tuple[Segment, Tensor]]:
        # One flat run per (unit, group) unless shapes are asked for: an elementwise rule
        # then makes a few long calls instead of one short call per parameter.
        out = []
        for u in self.units:
            lo, hi = self.opt_range(u)
            for seg in u.segments(lo, hi, per_param=self.keep_shapes):
                view = u.master[seg.start - lo:seg.end - lo]
                if seg.param is not None:
                    view = view.view(seg.param.shape)
                out.append((seg, view))
        # Optimizer index order = group order (see param_groups); checkpoints rely on it.
        return sorted(out, key=lambda sv: sv[0].group)

    def param_groups(self, options: dict[int, dict]) -> list[dict]:
        """Optimizer groups over the master views, with each group id's hyper-parameters."""
        groups: dict[int, list[Tensor]] = {}
        for seg, view in self.opt_segments:
            groups.setdefault(seg.group, []).append(view)
        out = [{"params": ps, **options[g], "group_id": g} for g, ps in sorted(groups.items())]
        return self.muon.param_groups(out, options) if self.muon is not None else out

    # ================================================================ gradient hooks
    def _hook(self, u: Unit, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._on_grad(u, i)
        return hook

    def _on_grad(self, u: Unit, i: int) -> None:
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

    def grad_norm_sq(self) -> float:
        """Squared global L2 norm of the (still scaled) gradient, identical on every rank."""
        local = foreach.sum_of_squares([self.owned_grad(u) for u in self.units], self.host)
        if self.shards_optimizer:
            local = self.comm.all_reduce_scalars(local.reshape(1))[0]
        return float(local)

    def scale_grads(self, factor: float) -> None:
        foreach.scale_([self.owned_grad(u) for u in self.units], factor)

    def attach_grads(self, segments: list[tuple[Segment, Tensor]] | None = None) -> None:
        """Point each optimizer tensor's .grad (of `segments`, default all) at its slice of
        the owned gradient."""
        grads = {}
        for seg, view in self.opt_segments if segments is None else segments:
            u = self.units[seg.unit]
            if u.index not in grads:
                g = self.owned_grad(u)
                grads[u.index] = g.to(view.dtype) if g.dtype != view.dtype else g
            lo = self.opt_range(u)[0]
            view.grad = grads[u.index][seg.start - lo:seg.end - lo].view(view.shape)

    def detach_grads(self) -> None:
        for _, view in self.opt_segments:
            view.grad = None

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Update the master weights from the owned (unscaled, clipped) gradients.

        `step_by_unit` (Offload on a GPU): the optimizer steps one unit at a time and each
        unit is published as soon as it is updated, so its host-to-device copy (and, below
        ZeRO-3, its all-gather) runs while the CPU updates the next unit — the same
        elementwise update, so the same numbers, in pieces.

        The optimizer's first-step hook (the compile vote, a collective) runs here first,
        on every rank: inside the first `optimizer.step()` it would come after unit 0's
        publish on a rank whose share of unit 0 is all padding (no step for it) and
        before it on the others — collectives in different orders, a hang on NCCL."""
        hook = getattr(optimizer, "before_first_step", None)
        if hook is not None:
            optimizer.before_first_step = None
            hook()
        if self.muon is not None:
            self.muon.step(optimizer)
            return
        if not self.step_by_unit:
            self.attach_grads()
            optimizer.step()
            self.detach_grads()
            return
        by_unit: dict[int, list[tuple[Segment, Tensor]]] = {}
        for seg, view in self.opt_segments:
            by_unit.setdefault(seg.unit, []).append((seg, view))
        for u in self.units:
            if u.index in by_unit:
                self.attach_grads(by_unit[u.index])
                optimizer.step()
                self.detach_grads()
            self.publish(u)

    def after_step(self) -> None:
        if not self.step_by_unit or self.muon is not None:  # else: published in the step
            for u in self.units:
                self.publish(u)
        self.wait_pending()
        self.after_publish()

    def after_publish(self) -> None:
        """Every rank holds the new weights (ZeRO-3 re-packs its FP8 gathers here)."""

    def zero_grad(self) -> None:
        self.grads.clear(self.units)

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter usable in full inside the block (ZeRO-3 gathers; collective)."""
        yield

    def close(self) -> None:
        self.comm.close()


def place_rest(model: nn.Module, device: torch.device, dtype: torch.dtype,
               init_buffers: Callable[[nn.Module], None] | None = None) -> None:
    """Move what the units do not own — buffers and frozen parameters — to the device
    (floating ones in the compute dtype), without touching trainable parameters.
    Buffers of a meta-device model are made on the device and filled by `init_buffers`."""
    fresh = []
    with torch.no_grad():
        for m in model.modules():
            for name, b in m.named_buffers(recurse=False):
                if b is None:
                    continue
                cast = dtype if b.is_floating_point() else None
                if b.device.type == "meta":
                    m._buffers[name] = torch.empty_like(b, device=device, dtype=cast)
                    fresh.append(m)
                else:
                    m._buffers[name] = b.to(device, cast)
            for p in m.parameters(recurse=False):
                if not p.requires_grad:
                    p.data = p.data.to(device, dtype if p.is_floating_point() else None)
    for m in dict.fromkeys(fresh):
        if init_buffers is None:
            raise ValueError(f"{type(m).__name__} has buffers on the meta device and the model's "
                             "plan cannot make them (Plan.init_buffers); build it on a real device")
        init_buffers(m)
