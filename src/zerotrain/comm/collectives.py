"""The only door from zerotrain to the wire.

Strategies call `Comm.all_reduce / reduce_scatter / all_gather`; this is where the
algorithm is chosen (`native`: torch.distributed's own collective, `ring`: SPEC §5
written over isend/irecv in `ring.py`, `auto`: the ring for large reduce-scatters and
all-gathers on gloo — whose own reduce-scatter is slow and sends the whole buffer — and
native otherwise, gloo's all-reduce being faster than the ring's two passes) and where
every byte is counted.

Devices: `Comm.device` is where tensors for the group must live — the CPU for gloo,
the current GPU for NCCL, which has no CPU backend at all. Control reductions
(`all_reduce_scalars`: loss, norms, eval totals, flags) take host numbers, move them
there and give host numbers back, so callers never need to know the backend.

Threads: on gloo, async ring collectives run on one worker thread, where they overlap
the caller's computation. On NCCL they run on the calling thread: NCCL calls already
return at once (the GPU does the waiting), a second thread would only queue its
transfers on the device's default stream behind the training kernels, and two host
threads driving two NCCL communicators in per-rank orders can deadlock.

Counting: for `ring` we record the bytes actually handed to isend/irecv (observed).
For `native` the backend's internals are invisible, so we record the payload times the
standard ring factor ((N-1)/N per reduce-scatter or all-gather pass) and label it
computed. Distributed Muon's uneven exchanges (`all_to_all`, `scatter`) are native only
and count their exact payload to other ranks. Only SUM is offered: strategies pre-divide
gradients by the world size, which also works on backends without an AVG op (gloo).
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from zerotrain.comm.dist import comm_device
from zerotrain.comm.lockstep import Lockstep, explain_timeout

ALGORITHMS = ("native", "ring", "auto")
RING_MIN_BYTES = 2 << 20  # auto: below this the comm-thread hand-off costs more than it saves


@dataclass
class OpTraffic:
    calls: int = 0
    sent: int = 0
    recv: int = 0
    observed: bool = True  # False: computed from the algorithm's standard factor


@dataclass
class TrafficCounter:
    """Bytes per (operation, purpose) since the last reset; one per Comm."""

    ops: dict[tuple[str, str], OpTraffic] = field(default_factory=dict)

    def add(self, op: str, purpose: str, sent: int, recv: int, observed: bool) -> None:
        t = self.ops.setdefault((op, purpose), OpTraffic(observed=observed))
        t.calls += 1
        t.sent += int(sent)
        t.recv += int(recv)
        t.observed = t.observed and observed

    def reset(self) -> None:
        self.ops.clear()

    def total(self, exclude: tuple[str, ...] = ("control",)) -> tuple[int, int]:
        sent = sum(t.sent for (_, p), t in self.ops.items() if p not in exclude)
        recv = sum(t.recv for (_, p), t in self.ops.items() if p not in exclude)
        return sent, recv

    def snapshot(self) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(dict)
        for (op, purpose), t in sorted(self.ops.items()):
            out[purpose][op] = {
                "calls": t.calls, "sent_bytes": t.sent, "recv_bytes": t.recv,
                "how": "observed" if t.observed else "computed",
            }
        return dict(out)


class Handle:
    """Uniform wait() over a torch Work, a ring job on the comm thread, or nothing.

    `explain` turns a backend timeout into an error that names the setting."""

    def __init__(self, work: object | None = None, done: threading.Event | None = None,
                 explain: Callable[[BaseException], BaseException] | None = None):
        self._work = work
        self._done = done
        self._error: BaseException | None = None
        self._explain = explain

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                better = self._explain(e) if self._explain is not None else e
                if better is e:
                    raise
                raise better from e
            self._work = None
        if self._done is not None:
            self._done.wait()
            if self._error is not None:
                raise self._error


class _CommThread:
    """One FIFO worker per Comm: async ring collectives run here, in submission order.

    Every rank submits the same sequence, so the point-to-point exchanges pair up; the
    thread uses its own process group so it never interleaves with main-thread calls.
    """

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="zerotrain-comm", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, handle = job
            try:
                fn()
            except BaseException as e:  # surfaced on wait()
                handle._error = e
            handle._done.set()

    def submit(self, fn: Callable[[], None]) -> Handle:
        h = Handle(done=threading.Event())
        self._q.put((fn, h))
        return h

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=30)


class Comm:
    """Collectives over one process group, with an algorithm switch and byte counters.

    `device`: where the group's tensors live (default: `comm_device(group)`).
    `check_lockstep`: compare every collective across ranks first (`lockstep.py`).
    `timeout_s`: the group's timeout, only to name it when a collective times out.
    """

    def __init__(self, algorithm: str = "native", group: dist.ProcessGroup | None = None,
                 ring_min_bytes: int = RING_MIN_BYTES, *, device: torch.device | None = None,
                 check_lockstep: bool = False, timeout_s: float | None = None,
                 grad_group: bool | str = "auto"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"comm.algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else None
        self.device = device if device is not None else comm_device(group)
        self.timeout_s = timeout_s
        self.counter = TrafficCounter()
        self.lockstep = (Lockstep(group, self.device, self.rank, self.world_size)
                         if check_lockstep and self.world_size > 1 else None)
        self._ring_group = None
        self._thread: _CommThread | None = None
        self.ring_min_bytes = ring_min_bytes
        gloo = self.backend == "gloo"
        self._ring_ok = (self.active and self.world_size > 1
                         and (algorithm == "ring" or (algorithm == "auto" and gloo)))
        ranks = (dist.get_process_group_ranks(group) if group else list(range(self.world_size))
                 ) if self.active else [0]
        if self._ring_ok:
            self._ring_group = dist.new_group(ranks)
            if gloo:  # see the module docstring: never a comm thread on NCCL
                self._thread = _CommThread()
        # Gradient reductions on a group of their own (`grad_group`; auto: on NCCL, where
        # each group is one CUDA stream, so ZeRO-3's reduce-scatters do not queue behind
        # the prefetch all-gathers). Every rank builds the same groups in the same order.
        self._grad_group, self._grad_ring_group = group, self._ring_group
        separate = self.backend == "nccl" if grad_group == "auto" else bool(grad_group)
        self.separate_grads = separate and self.active and self.world_size > 1
        if self.separate_grads:
            self._grad_group = dist.new_group(ranks)
            if self._ring_ok:
                self._grad_ring_group = dist.new_group(ranks)

    # ------------------------------------------------------------------ helpers
    def _ring(self, fn: Callable[[], tuple[int, int]], op: str, purpose: str,
              async_op: bool) -> Handle:
        def job() -> None:
            sent, recv = fn()
            self.counter.add(op, purpose, sent, recv, observed=True)

        if self._thread is None:  # NCCL: on this thread; the GPU queues it asynchronously
            self._guarded(job, op)
            return Handle()
        h = self._thread.submit(job)
        if not async_op:
            h.wait()
        return h

    def _check(self, op: str, purpose: str, t: Tensor) -> None:
        if self.lockstep is not None:
            self.lockstep.check(op, purpose, t.numel(), t.dtype)

    def _explain(self, op: str) -> Callable[[BaseException], BaseException]:
        seq = self.lockstep.seq if self.lockstep is not None else None
        what = op + (f" (collective #{seq})" if seq is not None else "")
        return lambda e: explain_timeout(e, what, self.rank, self.timeout_s)

    def _guarded(self, fn: Callable[[], object], op: str) -> object:
        try:
            return fn()
        except RuntimeError as e:
            better = self._explain(op)(e)
            if better is e:
                raise
            raise better from e

    def _native(self, fn: Callable[..., object], name: str, *args: object,
                async_op: bool, group: dist.ProcessGroup | None = None, **kw: object) -> Handle:
        """Issue a torch collective (on `group`, default the Comm's); a synchronous one is
        an async one waited for."""
        g = self.group if group is None else group
        work = self._guarded(lambda: fn(*args, group=g, async_op=True, **kw), name)
        h = Handle(work, explain=self._explain(name))
        if not async_op:
            h.wait()
        return h

    def _use_ring(self, nbytes: int, op: str) -> bool:
        if not self._ring_ok:
            return False
        return self.algorithm == "ring" or (op != "all_reduce" and nbytes >= self.ring_min_bytes)

    def _native_factor(self) -> float:
        return (self.world_size - 1) / self.world_size

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, *, purpose: str = "grads",
                   async_op: bool = False) -> Handle:
        """In-place SUM across ranks."""
        if self.world_size == 1:
            return Handle()
        self._check("all_reduce", purpose, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        grads = purpose == "grads"
        if purpose != "control" and self._use_ring(nbytes, "all_reduce"):
            from zerotrain.comm.ring import ring_all_reduce

            ring = self._grad_ring_group if grads else self._ring_group
            return self._ring(lambda: ring_all_reduce(tensor, ring),
                              "all_reduce", purpose, async_op)
        moved = 2 * self._native_factor() * nbytes
        self.counter.add("all_reduce", purpose, moved, moved, observed=False)
        return self._native(dist.all_reduce, "all_reduce", tensor, async_op=async_op,
                            group=self._grad_group if grads else None)

    def reduce_scatter(self, output: Tensor, input: Tensor, *, purpose: str = "grads",
                       async_op: bool = False) -> Handle:
        """SUM of `input` across ranks; rank r receives chunk r (len = output.numel())."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter input has {input.numel()} elements, expected "
                f"{self.world_size} x {output.numel()} (pad the flat buffer)"
            )
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        self._check("reduce_scatter", purpose, input)
        grads = purpose == "grads"
        if self._use_ring(input.numel() * input.element_size(), "reduce_scatter"):
            from zerotrain.comm.ring import ring_reduce_scatter

            ring = self._grad_ring_group if grads else self._ring_group
            return self._ring(lambda: ring_reduce_scatter(output, input, ring),
                              "reduce_scatter", purpose, async_op)
        moved = self._native_factor() * input.numel() * input.element_size()
        self.counter.add("reduce_scatter", purpose, moved, moved, observed=False)
        return self._native(_reduce_scatter(), "reduce_scatter", output, input,
                            async_op=async_op, group=self._grad_group if grads else None)

    def all_gather(self, output: Tensor, input: Tensor, *, purpose: str = "params",
                   async_op: bool = False) -> Handle:
        """Concatenate every rank's `input` into `output` (rank order)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather output has {output.numel()} elements, expected "
                f"{self.world_size} x {input.numel()}"
            )
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        self._check("all_gather", purpose, output)
        if self._use_ring(output.numel() * output.element_size(), "all_gather"):
            from zerotrain.comm.ring import ring_all_gather

            return self._ring(lambda: ring_all_gather(output, input, self._ring_group),
                              "all_gather", purpose, async_op)
        moved = self._native_factor() * output.numel() * output.element_size()
        self.counter.add("all_gather", purpose, moved, moved, observed=False)
        return self._native(_all_gather(), "all_gather", output, input, async_op=async_op)

    # ------------------------------------------------------------------ uneven exchanges
    # Always native: their messages go point to point already (no ring to choose), so the
    # bytes counted are exactly the payload each rank hands to every other rank.
    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int],
                   input_splits: list[int], *, purpose: str = "muon",
                   async_op: bool = False) -> Handle:
        """Rank r sends `input`'s piece d (sizes `input_splits`) to rank d and receives
        rank s's piece r into `output`'s piece s (sizes `output_splits`)."""
        n = self.world_size
        if len(input_splits) != n or len(output_splits) != n:
            raise ValueError(f"all_to_all needs {n} input and output splits")
        if sum(input_splits) != input.numel() or sum(output_splits) != output.numel():
            raise ValueError("all_to_all splits must add up to the tensors' sizes")
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        self._check("all_to_all", purpose, input.new_empty(0))  # sizes differ by rank
        size = input.element_size()
        sent = (sum(input_splits) - input_splits[self.rank]) * size
        recv = (sum(output_splits) - output_splits[self.rank]) * size
        self.counter.add("all_to_all", purpose, sent, recv, observed=False)
        return self._native(dist.all_to_all_single, "all_to_all", output, input,
                            output_splits, input_splits, async_op=async_op)

    def scatter(self, output: Tensor, inputs: list[Tensor] | None, src: int, *,
                purpose: str = "muon") -> Handle:
        """Rank `src` sends `inputs[r]` (all `output`'s size) to every rank r."""
        if self.rank == src and (inputs is None or len(inputs) != self.world_size):
            raise ValueError(f"scatter: rank {src} must give {self.world_size} inputs")
        if self.world_size == 1:
            output.copy_(inputs[0])  # type: ignore[index]
            return Handle()
        self._check("scatter", purpose, output)
        nbytes = output.numel() * output.element_size()
        if self.rank == src:
            self.counter.add("scatter", purpose, nbytes * (self.world_size - 1), 0,
                             observed=False)
        else:
            self.counter.add("scatter", purpose, 0, nbytes, observed=False)
        return self._native(dist.scatter, "scatter", output,
                            inputs if self.rank == src else None, src=src, async_op=False)

    def all_reduce_scalars(self, values: list[float] | Tensor, op: str = "sum") -> Tensor:
        """Small control reductions (norms, overflow flags, losses, eval totals): fp64,
        native. Takes host numbers (or a tensor on any device), reduces them on
        `self.device` — NCCL cannot see CPU tensors — and returns a float64 CPU tensor."""
        host = (values.detach() if isinstance(values, Tensor)
                else torch.tensor(values, dtype=torch.float64))
        wire = host.to(self.device, torch.float64)
        if self.world_size > 1:
            self._check("all_reduce_scalars", "control", wire)
            rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            nbytes = wire.numel() * wire.element_size()
            moved = 2 * self._native_factor() * nbytes
            self.counter.add("all_reduce", "control", moved, moved, observed=False)
            self._native(dist.all_reduce, "all_reduce_scalars", wire, op=rop, async_op=False)
        return wire.cpu()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank (one MAX reduction)."""
        return bool(self.all_reduce_scalars([float(flag)], op="max")[0] > 0)

    def close(self) -> None:
        """Stop the comm thread and destroy the groups this Comm made (the ring's, the
        gradients' own): on NCCL each is a communicator with its own device buffers, which
        would otherwise live until the process group is destroyed. Idempotent."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        made = {id(g): g for g in (self._ring_group, self._grad_ring_group, self._grad_group)
                if g is not None and g is not self.group}
        if dist.is_initialized():
            for g in made.values():
                dist.destroy_process_group(g)
        self._ring_group = self._grad_ring_group = None
        self._grad_group, self.separate_grads = self.group, False


def _reduce_scatter() -> Callable[..., object]:
    """torch's single-tensor reduce-scatter under its current name (renamed in 2.x)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather() -> Callable[..., object]:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
