"""The only door from zerotrain to the wire.

Strategies call `Comm.all_reduce / reduce_scatter / all_gather / all_to_all`; this is
where the algorithm is chosen (`native`: torch.distributed's own collective, `ring`:
zerotrain's own over isend/irecv in `ring.py` — SPEC §5's ring, and the pairwise exchange
for all-to-all — `auto`: the ring for large reduce-scatters and all-gathers on gloo, whose
own reduce-scatter is slow and sends the whole buffer, and native otherwise, gloo's
all-reduce being faster than the ring's two passes) and where every byte is counted.

One dispatch path: every collective is a row of `OPS` (torch's function, ours, the bytes
the native one moves) run by `Comm._collective` — size check, world-of-one copy, lockstep
check, ring or native, byte count.

Groups: a `Comm` is bound to one process group. `comm.grads` is the Comm the gradient
reductions go to (a second group over the same ranks when `grad_group` asks for one: on
NCCL each group is one CUDA stream, so ZeRO-3's reduce-scatters do not queue behind the
prefetch all-gathers; otherwise the Comm itself). `comm.subgroup(ranks)` and
`comm.split(size)` make Comms over subsets of the ranks (sequence parallelism's groups of
S consecutive ranks, hpZ's nodes). `close()` destroys every group a Comm made, its
subgroups' included.

Devices: `Comm.device` is where tensors for the group must live — the CPU for gloo,
the current GPU for NCCL, which has no CPU backend at all. Control reductions
(`all_reduce_scalars`: loss, norms, eval totals, flags) take host numbers, move them
there and give host numbers back, so callers never need to know the backend.

Counting: for `ring` we record the bytes actually handed to isend/irecv (observed).
For `native` the backend's internals are invisible, so we record the payload times the
standard ring factor ((N-1)/N per reduce-scatter or all-gather pass) and label it
computed; an all-to-all or scatter counts its exact payload to other ranks. Only SUM is
offered: strategies pre-divide gradients by the world size, which also works on backends
without an AVG op (gloo).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from zerotrain.comm.dist import comm_device, default_node_size
from zerotrain.comm.handle import CommThread, Handle
from zerotrain.comm.lockstep import Lockstep, explain_timeout
from zerotrain.comm.ops import OPS, Op, nbytes
from zerotrain.comm.traffic import TrafficCounter

ALGORITHMS = ("native", "ring", "auto")
RING_MIN_BYTES = 2 << 20  # auto: below this the comm-thread hand-off costs more than it saves


# ---------------------------------------------------------------------- the Comm
class Comm:
    """Collectives over one process group, with an algorithm switch and byte counters.

    `device`: where the group's tensors live (default: `comm_device(group)`).
    `check_lockstep`: compare every collective across ranks first (`lockstep.py`).
    `timeout_s`: the group's timeout, only to name it when a collective times out.
    `grad_group`: give `comm.grads` a process group of its own (auto: on NCCL).
    `node_size`: ranks per node (consecutive global ranks share a node; default
    `LOCAL_WORLD_SIZE`, else every rank on one node) — only to split the byte counts
    into intra- and inter-node bytes and to let hpZ/qgZ find a rank's node.
    """

    def __init__(self, algorithm: str = "native", group: dist.ProcessGroup | None = None,
                 ring_min_bytes: int = RING_MIN_BYTES, *, device: torch.device | None = None,
                 check_lockstep: bool = False, timeout_s: float | None = None,
                 grad_group: bool | str = "auto", node_size: int | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"comm.algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self._bind(algorithm, group, ring_min_bytes, device, timeout_s)
        world = dist.get_world_size() if self.active else 1
        self.node_size = default_node_size(world) if node_size is None else node_size
        if self.node_size < 1 or world % self.node_size:
            raise ValueError(f"comm.node_size ({self.node_size}) must divide the world size "
                             f"({world}): set it to the ranks per node, a divisor of {world}")
        self.counter = TrafficCounter()
        self.lockstep = (Lockstep(group, self.device, self.rank, self.world_size)
                         if check_lockstep and self.world_size > 1 else None)
        ranks = self.ranks
        self._ring_group = self._new_group(ranks) if self._ring_ok else None
        self._thread = CommThread() if self._ring_ok and self.backend == "gloo" else None
        self._owns_thread = True
        # Every rank builds the same groups in the same order (torch requires it).
        separate = self.backend == "nccl" if grad_group == "auto" else bool(grad_group)
        self.grads: Comm = self
        if separate and self.active and self.world_size > 1:
            self.grads = self._child(dist.new_group(ranks), ranks, self.lockstep)

    def _bind(self, algorithm: str, group: dist.ProcessGroup | None, ring_min_bytes: int,
              device: torch.device | None, timeout_s: float | None) -> None:
        """The facts of the group; shared by the constructor and `_child`."""
        self.algorithm, self.group, self.ring_min_bytes = algorithm, group, ring_min_bytes
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else None
        self.device = device if device is not None else comm_device(group)
        self.timeout_s = timeout_s
        self.ranks = ((dist.get_process_group_ranks(group) if group is not None
                       else list(range(self.world_size))) if self.active else [0])
        self._ring_ok = (self.active and self.world_size > 1 and (
            algorithm == "ring" or (algorithm == "auto" and self.backend == "gloo")))
        self._made: list[dist.ProcessGroup] = []  # destroyed by close()
        self._children: list[Comm] = []  # closed by close()

    def _new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        """dist.new_group over `ranks` (this rank among them), destroyed by close()."""
        g = dist.new_group(ranks)
        self._made.append(g)
        return g

    def _child(self, group: dist.ProcessGroup | None, ranks: list[int],
               lockstep: Lockstep | None) -> Comm:
        """A Comm over `group` (this rank a member; the child owns it) sharing this one's
        counter and comm thread; its ring group is made here."""
        c = Comm.__new__(Comm)
        c._bind(self.algorithm, group, self.ring_min_bytes, self.device, self.timeout_s)
        c.counter, c.lockstep, c.grads = self.counter, lockstep, c
        c.node_size = self.node_size
        if group is not None:
            c._made.append(group)
        c._ring_group = c._new_group(ranks) if c._ring_ok else None
        c._thread, c._owns_thread = self._thread, False
        self._children.append(c)
        return c

    # ------------------------------------------------------------------ groups
    def subgroup(self, ranks: list[int]) -> Comm | None:
        """A Comm over `ranks` (this Comm's rank numbers; group rank i = i-th smallest).

        Collective: every rank of the world calls it with the same `ranks`, in the same
        order as its other group creations (torch's rule for new_group), so this Comm
        must span the world. Ranks outside `ranks` get None. The subgroup shares this
        Comm's traffic counter (a step's bytes are read in one place; tell them apart by
        `purpose`) and comm thread, has its own lockstep sequence when checking is on,
        the same algorithm and device, and is closed by this Comm's close()."""
        ranks = sorted(set(ranks))
        if self.active and self.world_size != dist.get_world_size():
            raise ValueError("Comm.subgroup: call it on the Comm over every rank (torch "
                             "makes process groups collectively over the whole world)")
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size:
            raise ValueError(f"Comm.subgroup: ranks {ranks} are not within the "
                             f"{self.world_size} ranks of this Comm")
        if not self.active:
            return self._child(None, ranks, None)
        group = dist.new_group(ranks)
        ring_ok = self._ring_ok and len(ranks) > 1
        if self.rank not in ranks:
            if ring_ok:  # the member ranks make the subgroup's ring group now: join in
                dist.new_group(ranks)
            return None
        mine = self._child(group, ranks, None)
        if self.lockstep is not None and mine.world_size > 1:
            mine.lockstep = Lockstep(group, self.device, mine.rank, mine.world_size)
        return mine

    def split(self, size: int) -> Comm:
        """This rank's group when the ranks are cut into groups of `size` consecutive
        ranks ([0..size-1], [size..2*size-1], ...). Collective, like `subgroup`."""
        if size < 1 or self.world_size % size:
            raise ValueError(f"Comm.split: group size {size} does not divide the "
                             f"{self.world_size} ranks")
        groups = [self.subgroup(list(range(k, k + size)))
                  for k in range(0, self.world_size, size)]
        mine = next(g for g in groups if g is not None)
        if self.lockstep is not None and mine.lockstep is not None:
            # every rank issues on its own group at the same points: checked in this
            # Comm's sequence, across communicators (lockstep.py, Lockstep)
            mine.lockstep = self.lockstep.channel(f"{size}-rank split groups")
        return mine

    # ------------------------------------------------------------------ dispatch
    def _collective(self, op: str, out: Tensor, inp: Tensor | None, purpose: str,
                    async_op: bool, *, numel: int | None = None, **kw: object) -> Handle:
        """Every collective: (sizes checked by the caller) a world of one copies `inp`
        into `out`; then the lockstep check, the ring or torch's own, the byte count."""
        spec = OPS[op]
        if self.world_size == 1:
            if inp is not None and out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Handle()
        if self.lockstep is not None:
            n = spec.numel(out, inp) if numel is None else numel
            self.lockstep.check(op, purpose, n, out.dtype)
        name = spec.counted_as or op
        if spec.ring is not None and purpose != "control" and self._use_ring(out, inp, spec):
            group = self._ring_group

            def job() -> None:
                sent, recv = spec.ring(out, inp, group, **kw)
                self.counter.add(name, purpose, sent, recv, observed=True,
                                 inter=self._inter(op, sent, recv, True, kw))

            return self._run_ring(job, op, async_op)
        sent, recv = spec.traffic(self.world_size, self.rank, out, inp, **kw)
        self.counter.add(name, purpose, sent, recv, observed=False,
                         inter=self._inter(op, sent, recv, False, kw))
        work = self._guarded(lambda: spec.native(out, inp, self.group, **kw), op)
        h = Handle(work, explain=self._explain(op))
        if not async_op:
            h.wait()
        return h

    # ------------------------------------------------------------------ nodes
    def node_of(self, i: int) -> int:
        """The node of this Comm's rank `i` (consecutive global ranks share a node)."""
        return self.ranks[i] // self.node_size

    @property
    def nodes(self) -> int:
        """How many nodes this Comm's ranks span."""
        return len({self.node_of(i) for i in range(self.world_size)})

    def _inter(self, op: str, sent: float, recv: float, ring: bool,
               kw: dict) -> tuple[float, float]:
        """The part of (sent, recv) that crossed nodes. The ring sends to the next rank
        and receives from the previous one; an all-to-all's pieces are known per peer; a
        native collective is counted as exchanging equal shares with every peer (its
        internals are invisible)."""
        n, me = self.world_size, self.rank
        mine = self.node_of(me)
        off = [self.node_of(i) != mine for i in range(n)]
        if op == "all_to_all":
            size = sent / max(1, sum(kw["in_splits"]) - kw["in_splits"][me]) if sent else 0
            rsize = recv / max(1, sum(kw["out_splits"]) - kw["out_splits"][me]) if recv else 0
            return (sum(s for s, o in zip(kw["in_splits"], off) if o) * size,
                    sum(s for s, o in zip(kw["out_splits"], off) if o) * rsize)
        if ring:
            return (sent if off[(me + 1) % n] else 0, recv if off[(me - 1) % n] else 0)
        frac = sum(off) / (n - 1)
        return sent * frac, recv * frac

    def _use_ring(self, out: Tensor, inp: Tensor | None, spec: Op) -> bool:
        if not self._ring_ok:
            return False
        size = max(nbytes(out), nbytes(inp) if inp is not None else 0)
        return self.algorithm == "ring" or (spec.auto_ring and size >= self.ring_min_bytes)

    def _run_ring(self, job: Callable[[], None], op: str, async_op: bool) -> Handle:
        if self._thread is None:  # NCCL: on this thread; the GPU queues it asynchronously
            self._guarded(job, op)
            return Handle()
        h = self._thread.submit(job)
        if not async_op:
            h.wait()
        return h

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

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, *, purpose: str = "grads",
                   async_op: bool = False) -> Handle:
        """In-place SUM across ranks (`purpose="control"`: always native)."""
        return self._collective("all_reduce", tensor, tensor, purpose, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, *, purpose: str = "grads",
                       async_op: bool = False) -> Handle:
        """SUM of `input` across ranks; rank r receives chunk r (len = output.numel())."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter input has {input.numel()} elements, expected "
                f"{self.world_size} x {output.numel()} (pad the flat buffer)"
            )
        return self._collective("reduce_scatter", output, input, purpose, async_op)

    def all_gather(self, output: Tensor, input: Tensor, *, purpose: str = "params",
                   async_op: bool = False) -> Handle:
        """Concatenate every rank's `input` into `output` (rank order)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather output has {output.numel()} elements, expected "
                f"{self.world_size} x {input.numel()}"
            )
        return self._collective("all_gather", output, input, purpose, async_op)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None, *, purpose: str = "muon",
                   async_op: bool = False) -> Handle:
        """Rank r sends `input`'s piece d (sizes `input_splits`) to rank d and receives
        rank s's piece r into `output`'s piece s (sizes `output_splits`). Without splits
        the pieces are equal (numel / world each: sequence parallelism's exchange)."""
        n = self.world_size
        explicit = output_splits is not None or input_splits is not None
        if not explicit:
            if input.numel() % n or output.numel() != input.numel():
                raise ValueError(f"all_to_all with equal pieces needs input and output of "
                                 f"the same size, divisible by {n}")
            output_splits = input_splits = [input.numel() // n] * n
        if output_splits is None or input_splits is None \
                or len(input_splits) != n or len(output_splits) != n:
            raise ValueError(f"all_to_all needs {n} input and output splits")
        if sum(input_splits) != input.numel() or sum(output_splits) != output.numel():
            raise ValueError("all_to_all splits must add up to the tensors' sizes")
        # Uneven pieces differ by rank, so the lockstep fingerprint cannot compare sizes.
        return self._collective("all_to_all", output, input, purpose, async_op,
                                numel=0 if explicit else None,
                                out_splits=output_splits, in_splits=input_splits)

    def scatter(self, output: Tensor, inputs: list[Tensor] | None, src: int, *,
                purpose: str = "muon") -> Handle:
        """Rank `src` (a rank of this Comm) sends `inputs[r]` (all `output`'s size) to
        every rank r. Native only: one sender, nothing for a ring to share."""
        if self.rank == src and (inputs is None or len(inputs) != self.world_size):
            raise ValueError(f"scatter: rank {src} must give {self.world_size} inputs")
        own = inputs[self.rank] if self.rank == src and inputs is not None else None
        return self._collective("scatter", output, own, purpose, False,
                                inputs=inputs if self.rank == src else None, src=src)

    def all_reduce_scalars(self, values: list[float] | Tensor, op: str = "sum") -> Tensor:
        """Small control reductions (norms, overflow flags, losses, eval totals): fp64,
        native. Takes host numbers (or a tensor on any device), reduces them on
        `self.device` — NCCL cannot see CPU tensors — and returns a float64 CPU tensor."""
        host = (values.detach() if isinstance(values, Tensor)
                else torch.tensor(values, dtype=torch.float64))
        wire = host.to(self.device, torch.float64)
        rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self._collective("all_reduce_scalars", wire, wire, "control", False, reduce=rop)
        return wire.cpu()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank (one MAX reduction)."""
        return bool(self.all_reduce_scalars([float(flag)], op="max")[0] > 0)

    def close(self) -> None:
        """Stop the comm thread (after the jobs queued on it) and destroy every group this
        Comm made — the ring's, the gradients' own, its subgroups' — : on NCCL each is a
        communicator with its own device buffers, which would otherwise live until the
        process group is destroyed. The group it was given is not its to destroy.
        Idempotent. Wait for a subgroup's handles before closing it alone."""
        if self._thread is not None and self._owns_thread:
            self._thread.close()
        self._thread = None
        for c in self._children:
            c.close()
        if dist.is_initialized():
            for g in self._made:
                dist.destroy_process_group(g)
        self._made, self._children = [], []
        self._ring_group, self.grads = None, self
