"""The Strategy interface and the machinery every ZeRO stage shares.

A strategy owns the model states (parameters, gradients, FP32 master weights) laid out
in `FlatUnit`s, decides what each rank keeps, and talks to the other ranks through
`Comm`. The engine only calls:

    pre_backward(boundary) -> [autograd runs; our hooks fire] -> finish_backward()
    grad_norm_sq() -> scale_grads(f) -> optimizer.step() -> after_step() -> zero_grad()

Each stage is a small subclass that answers four questions: how parameters are cut into
units, where a unit's gradients accumulate, what to send when a unit's gradients are
complete, and how updated weights get back to every rank. Everything else — hooks,
optimizer views, norms, audits, checkpoints — lives here, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.config import ZeroConfig
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.zero.flat import FlatUnit, Segment, bucket_params

NamedParams = list[tuple[str, nn.Parameter, int]]
CATEGORIES = ("params", "grads", "master", "optimizer")


def in_backward() -> bool:
    """True while autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class Strategy:
    name = "ddp"
    stage = 0
    shards_optimizer = False  # ZeRO-1+: master weights and optimizer states are 1/N
    shards_grads = False      # ZeRO-2+: only the gradient shard outlives the backward
    shards_params = False     # ZeRO-3: parameters are 1/N between uses
    offload = False           # Offload: master, gradient shard, optimizer states on host
    communicates_every_micro_step = False
    max_in_flight = 2

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, comm: Comm, cfg: ZeroConfig,
                 device: torch.device, group_of: Callable[[str, nn.Parameter], int],
                 keep_shapes: bool = False):
        """`keep_shapes`: hand the optimizer one tensor per parameter with its real shape
        (Muon needs matrices; stage 0 only) instead of one flat run per group."""
        self.model, self.policy, self.comm, self.cfg = model, policy, comm, cfg
        self.keep_shapes = keep_shapes
        self.device = device
        self.host = torch.device("cpu") if self.offload else device
        self.rank, self.world = comm.rank, comm.world_size
        named = [(n, p, group_of(n, p)) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        model.to(device)
        self.units: list[FlatUnit] = [
            FlatUnit.build(i, name, ps, self.world, self.rank)
            for i, (name, ps) in enumerate(self.make_units(named))
        ]
        for u in self.units:
            u.materialize(policy.param_dtype, device)
        self.init_grads()
        self.master: list[Tensor] = [self.make_master(u) for u in self.units]
        self.opt_segments: list[tuple[Segment, Tensor]] = self._optimizer_views()
        self.optimizer: torch.optim.Optimizer | None = None  # set by the engine
        self._pending: list[tuple[Handle, Callable[[], None] | None]] = []
        self._ready: list[set[int]] = [set() for _ in self.units]
        self._launched = [False] * len(self.units)
        self._communicate = True
        self._callback_queued = False
        self._open = False
        self._register_grad_hooks()

    # ================================================================ stage questions
    def make_units(self, named: NamedParams) -> list[tuple[str, NamedParams]]:
        """Stages 0–2: size-bounded buckets in reverse order (gradient readiness order)."""
        numel = max(1, int(self.cfg.bucket_mb * 2**20 / self.policy.reduce_dtype.itemsize))
        return [(f"bucket{i}", b) for i, b in enumerate(bucket_params(named, numel))]

    def init_grads(self) -> None:
        """Stages 0–1: one persistent full-size gradient buffer per unit."""
        self.grad_full = [torch.zeros(u.padded_numel, dtype=self.policy.grad_dtype,
                                      device=self.device) for u in self.units]
        self._install_grad_views()

    def grad_target(self, u: FlatUnit) -> Tensor:
        """The full-size buffer a unit's parameter gradients accumulate into."""
        return self.grad_full[u.index]

    def launch(self, u: FlatUnit) -> None:
        """The unit's gradients are complete on this rank: start its reduction."""
        raise NotImplementedError

    def owned_grad(self, u: FlatUnit) -> Tensor:
        """Gradient covering `opt_range(u)`, in the coordinates of `self.master[u]`."""
        lo, hi = self.opt_range(u)
        return self.grad_full[u.index][lo:hi]

    def publish(self, u: FlatUnit) -> None:
        """After the update: make every rank's parameters equal the new master weights."""
        lo, hi = self.opt_range(u)
        self._write_master_into(u, u.flat[lo:hi])

    def clear_grads(self) -> None:
        for g in self.grad_full:
            g.zero_()

    # ================================================================ layout
    def opt_range(self, u: FlatUnit) -> tuple[int, int]:
        """The slice of the unit's flat coordinates this rank's optimizer updates."""
        return u.shard_range if self.shards_optimizer else (0, u.padded_numel)

    def make_master(self, u: FlatUnit) -> Tensor:
        lo, hi = self.opt_range(u)
        return self.master_for(u.flat[lo:hi])

    def master_for(self, own: Tensor) -> Tensor:
        """The optimizer's copy of the weights in `own`: a separate FP32 (or host) tensor
        in mixed precision or Offload; otherwise `own` itself — the parameters are their
        own master (fp32, bf16-pure)."""
        if self.policy.has_master or self.offload:
            master = self.alloc_host(own.numel(), self.policy.master_dtype or own.dtype)
            master.copy_(own)
            return master
        return own

    def alloc_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Zeros on the host side of the split (pinned when it is really a CPU-GPU split)."""
        pin = self.host.type == "cpu" and self.device.type == "cuda"
        return torch.zeros(numel, dtype=dtype, device=self.host, pin_memory=pin)

    def _optimizer_views(self) -> list[tuple[Segment, Tensor]]:
        # One flat run per (unit, group) unless shapes are asked for: an elementwise rule
        # then makes a few long calls instead of one short call per parameter.
        out = []
        for u in self.units:
            lo, hi = self.opt_range(u)
            for seg in u.segments(lo, hi, per_param=self.keep_shapes):
                view = self.master[u.index][seg.start - lo:seg.end - lo]
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
        return [{"params": ps, **options[g], "group_id": g} for g, ps in sorted(groups.items())]

    def _write_master_into(self, u: FlatUnit, dst: Tensor) -> None:
        src = self.master[u.index]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src, non_blocking=True)

    # ================================================================ gradient hooks
    def _install_grad_views(self) -> None:
        """Let autograd accumulate straight into the flat buffer when dtypes agree."""
        if self.policy.grad_dtype != self.policy.param_dtype:
            return
        for u in self.units:
            for s in u.slots:
                s.param.grad = u.view_of(self.grad_full[u.index], s)

    def _register_grad_hooks(self) -> None:
        for u in self.units:
            for i, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(self._make_hook(u, i))

    def _make_hook(self, u: FlatUnit, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._on_grad(u, i)
        return hook

    def _on_grad(self, u: FlatUnit, i: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        slot = u.slots[i]
        g = slot.param.grad
        dst = u.view_of(self.grad_target(u), slot)
        if g is not None and g.data_ptr() != dst.data_ptr():
            dst.add_(g.view(slot.shape))
            # from now on autograd accumulates in place into the buffer (dtypes allowing)
            slot.param.grad = dst if dst.dtype == g.dtype else None
        self._ready[u.index].add(i)
        if (self._communicate and self.cfg.overlap and not self._launched[u.index]
                and len(self._ready[u.index]) == len(u.slots)):
            self._launched[u.index] = True
            self.launch(u)

    # ================================================================ engine calls
    def pre_backward(self, boundary: bool) -> None:
        """Called before each backward; on non-boundary micro-steps stages 0–1 stay quiet."""
        self._communicate = boundary or self.communicates_every_micro_step
        self._callback_queued = False
        self._open = True

    def finish_backward(self) -> None:
        """End of backward (autograd callback): reduce late units, wait for all traffic."""
        if not self._open:  # already finished by the autograd callback
            return
        self._open = False
        if self._communicate:
            # Units not launched yet (overlap off, or parameters that got no gradient) go
            # now, in unit order; every rank does the same, so the collectives pair up.
            for u in self.units:
                if not self._launched[u.index]:
                    self._launched[u.index] = True
                    self.launch(u)
        self.wait_pending()
        for r in self._ready:
            r.clear()
        self._launched = [False] * len(self.units)
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

    def grad_norm_sq(self) -> float:
        """Squared global L2 norm of the (still scaled) gradient, identical on every rank."""
        local = torch.zeros((), dtype=torch.float64, device=self.host)
        for u in self.units:
            g = self.owned_grad(u)
            local += torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
        if self.shards_optimizer:
            local = self.comm.all_reduce_scalars(local.reshape(1).cpu())[0]
        return float(local)

    def scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            for u in self.units:
                self.owned_grad(u).mul_(factor)

    def attach_grads(self) -> None:
        """Point each optimizer tensor's .grad at its slice of the owned gradient (fp32)."""
        grads = {}
        for seg, view in self.opt_segments:
            u = self.units[seg.unit]
            if u.index not in grads:
                g = self.owned_grad(u)
                grads[u.index] = g.to(view.dtype) if g.dtype != view.dtype else g
            lo = self.opt_range(u)[0]
            view.grad = grads[u.index][seg.start - lo:seg.end - lo].view(view.shape)

    def detach_grads(self) -> None:
        for _, view in self.opt_segments:
            view.grad = None

    def after_step(self) -> None:
        for u in self.units:
            self.publish(u)
        self.wait_pending()

    def zero_grad(self) -> None:
        self.clear_grads()

    # ================================================================ audit
    def tensors_by_category(self) -> list[tuple[str, str, Tensor]]:
        """(category, placement, tensor) for every persistent model-state tensor."""
        out: list[tuple[str, str, Tensor]] = []
        dev = "device"
        host = "host" if self.offload else "device"
        out += [("params", dev, t) for t in self.param_tensors()]
        out += [("grads", host if self.shards_grads else dev, t) for t in self.grad_tensors()]
        out += [("master", host, t) for t in self.master]
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                out += [("optimizer", host, t) for t in st.values()
                        if isinstance(t, Tensor) and t.numel() > 1]
        return out

    def param_tensors(self) -> list[Tensor]:
        return [u.flat for u in self.units]

    def grad_tensors(self) -> list[Tensor]:
        return list(self.grad_full)

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes held per category on device and host; shared storage counted once."""
        out = {p: dict.fromkeys(CATEGORIES, 0) for p in ("device", "host")}
        seen: set[int] = set()
        for cat, place, t in self.tensors_by_category():
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            out[place][cat] += st.nbytes()
        return out

    def buffer_numels(self) -> list[int]:
        return [u.numel for u in self.units]

    # ================================================================ checkpoint
    def layout(self) -> dict:
        return {"strategy": self.name, "stage": self.stage, "world_size": self.world,
                "units": [u.layout() for u in self.units]}

    def segment_table(self) -> list[list[int]]:
        """Per optimizer tensor (in optimizer order): [unit, start, end] in flat coords."""
        return [[s.unit, s.start, s.end] for s, _ in self.opt_segments]

    def master_shards(self) -> dict[str, Tensor]:
        return {f"master.{u.index}": self.master[u.index] for u in self.units}

    def load_master_shards(self, tensors: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for u in self.units:
                self.master[u.index].copy_(tensors[f"master.{u.index}"])
            for u in self.units:
                self.publish(u)
            self.wait_pending()

    def close(self) -> None:
        self.comm.close()
