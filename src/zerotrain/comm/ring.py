"""Ring all-reduce (SPEC §5) written over point-to-point sends and receives.

This is the legible twin of torch.distributed's built-in collectives: the same result,
with every chunk movement visible. One pure function, `ring_schedule`, says who sends
which chunk at each step; the tensor code below and the symbolic walk-through of
`zerotrain ring` (`cli/ring.py`) both read it, so the explanation cannot drift from the
implementation.

Schedule for N ranks, chunk indices mod N:
  reduce-scatter, step s = 0..N-2: rank r sends chunk (r-s) to r+1 and adds the chunk
      (r-s-1) it receives from r-1. Afterwards rank r holds the full sum of chunk r+1.
  all-gather, step s = 0..N-2: rank r sends its finished chunk (r+1-s) to r+1 and
      overwrites chunk (r-s) with what arrives from r-1.
Each rank therefore sends 2(N-1)/N of the buffer: nearly independent of N.

Every function returns (bytes_sent, bytes_received): the bytes this rank actually handed
to isend / irecv, so the traffic counters report observations, not formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class Transfer:
    """One message of one step: `src` sends chunk `chunk` to its ring successor `dst`."""

    src: int
    dst: int
    chunk: int


@dataclass(frozen=True)
class Step:
    """One ring step: every rank sends exactly one chunk (transfers[r].src == r)."""

    phase: str  # REDUCE_SCATTER or ALL_GATHER
    index: int  # 0-based within the phase
    transfers: tuple[Transfer, ...]

    def send_chunk(self, rank: int) -> int:
        return self.transfers[rank].chunk

    def recv_chunk(self, rank: int) -> int:
        """The chunk `rank` receives: the one its predecessor sends."""
        return self.transfers[(rank - 1) % len(self.transfers)].chunk


def ring_schedule(n: int, shift: int = 0) -> list[Step]:
    """The 2(N-1) steps of ring all-reduce over N ranks, exactly as SPEC §5 states them.

    `shift` relabels chunks (chunk c becomes c + shift mod N). The standalone
    reduce-scatter / all-gather use shift=-1 so that rank r finishes on chunk r (torch's
    semantics) instead of chunk r+1, without a second, different schedule to get wrong.
    """
    if n < 1:
        raise ValueError(f"a ring needs at least one rank, got {n}")
    steps: list[Step] = []
    for s in range(n - 1):
        steps.append(Step(REDUCE_SCATTER, s, tuple(
            Transfer(r, (r + 1) % n, (r - s + shift) % n) for r in range(n))))
    for s in range(n - 1):
        steps.append(Step(ALL_GATHER, s, tuple(
            Transfer(r, (r + 1) % n, (r + 1 - s + shift) % n) for r in range(n))))
    return steps


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Split numel into n chunks whose sizes differ by at most one (larger ones first).

    Any numel works, including numel < n (the tail chunks are empty and never sent).
    """
    base, extra = divmod(numel, n)
    return [base + (1 if c < extra else 0) for c in range(n)]


def ring_bytes(numel: int, n: int, rank: int, element_size: int = 1) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank` in one `ring_all_reduce` of `numel` elements.

    Reduce-scatter: rank r sends every chunk but (r+1), the one it finishes on, and
    receives every chunk but its own r. All-gather: it sends every chunk but (r+2), the
    one it never holds finished before the last step, and receives every chunk but (r+1).
    With chunks of `chunk_sizes` this is exact; 2(N-1)/N of the buffer when N divides it.
    O(1) in N, so it also answers for rings too large to replay step by step.
    """
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in a ring of {n}")
    if n == 1:
        return 0, 0
    base, extra = divmod(numel, n)

    def size(c: int) -> int:  # chunk_sizes(numel, n)[c % n] without the list
        return (base + (1 if c % n < extra else 0)) * element_size

    total = numel * element_size
    return (2 * total - size(rank + 1) - size(rank + 2),
            2 * total - size(rank) - size(rank + 1))


# ---------------------------------------------------------------------- plumbing
@dataclass(frozen=True)
class _Ring:
    n: int
    rank: int
    prev: int  # global rank of r-1 (what isend/irecv address)
    next: int  # global rank of r+1
    group: dist.ProcessGroup | None


def _ring(group: dist.ProcessGroup | None) -> _Ring:
    if not (dist.is_available() and dist.is_initialized()):
        return _Ring(1, 0, 0, 0, group)
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    if r < 0:
        raise RuntimeError("this process is not a member of the ring's process group")
    return _Ring(n, r, _peer(group, n, r - 1), _peer(group, n, r + 1), group)


def _peer(group: dist.ProcessGroup | None, n: int, i: int) -> int:
    """The global rank (what isend/irecv address) of group rank i mod n."""
    i %= n
    return dist.get_global_rank(group, i) if group is not None else i


def _exchange(ring: _Ring, send: Tensor, recv: Tensor) -> tuple[int, int]:
    """Send to r+1 and receive from r-1 as one batch, then wait for both."""
    return _sendrecv(send, ring.next, recv, ring.prev, ring.group)


def _sendrecv(send: Tensor, dst: int, recv: Tensor, src: int,
              group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Send `send` to global rank `dst` and receive `recv` from `src` as one batch.

    Every rank is at once a sender and a receiver, so the two must progress together.
    `batch_isend_irecv` posts them as one group (one ncclGroupStart/End on NCCL): two
    separate isend/irecv calls are serialised on NCCL's single stream per communicator,
    where a send can wait for its matching receive, which waits behind the peer's own
    send — a cycle around the ring. On gloo the batch is the same two operations.
    Empty chunks (numel < N) are skipped on both sides; both sides know the chunk sizes,
    so the skips agree.
    """
    ops = []
    sent = recv_bytes = 0
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        sent = send.numel() * send.element_size()
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
        recv_bytes = recv.numel() * recv.element_size()
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return sent, recv_bytes


def _flat(t: Tensor) -> Tensor:
    """A flat view when possible; a contiguous copy otherwise (the caller copies back)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).contiguous()


# ---------------------------------------------------------------------- collectives
def ring_all_reduce(tensor: Tensor, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """In-place SUM of `tensor` across the group by the SPEC §5 ring.

    Chunks are views of the tensor itself, so the reduce-scatter accumulates in place and
    the all-gather receives finished chunks straight into their final position; only
    the incoming partial sums need a scratch buffer (one chunk long).
    """
    ring = _ring(group)
    if ring.n == 1:
        return 0, 0
    flat = _flat(tensor)
    sizes = chunk_sizes(flat.numel(), ring.n)
    chunks = list(flat.split(sizes))
    scratch = torch.empty(max(sizes), dtype=flat.dtype, device=flat.device)
    sent = recv = 0
    for step in ring_schedule(ring.n):
        out_c, in_c = step.send_chunk(ring.rank), step.recv_chunk(ring.rank)
        if step.phase == REDUCE_SCATTER:
            buf = scratch[: sizes[in_c]]
            s, rv = _exchange(ring, chunks[out_c], buf)
            chunks[in_c].add_(buf)
        else:
            s, rv = _exchange(ring, chunks[out_c], chunks[in_c])
        sent, recv = sent + s, recv + rv
    if not tensor.is_contiguous():  # flat was a copy
        tensor.copy_(flat.view_as(tensor))
    return sent, recv


def ring_reduce_scatter(output: Tensor, input: Tensor,
                        group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """`output` = SUM over ranks of chunk r of `input` (torch's reduce_scatter semantics).

    Runs only the reduce-scatter half of the ring, with chunks relabelled by -1
    (`ring_schedule(n, shift=-1)`) so rank r finishes on chunk r. Partial sums travel in
    two ping-pong buffers, so `input` is only read; and rank r never sends its own chunk
    r, reading it just once at the very end, so `output` may alias that chunk of `input`
    (ZeRO-1's in-place reduce-scatter into the rank's own shard).
    """
    ring = _ring(group)
    m = output.numel()
    if input.numel() != ring.n * m:
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, "
                         f"expected {ring.n} x {m}")
    if ring.n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return 0, 0
    inp = _flat(input)

    def chunk(c: int) -> Tensor:
        return inp[c * m:(c + 1) * m]

    bufs = [torch.empty(m, dtype=inp.dtype, device=inp.device) for _ in range(2)]
    sent = recv = 0
    steps = [s for s in ring_schedule(ring.n, shift=-1) if s.phase == REDUCE_SCATTER]
    outgoing = chunk(steps[0].send_chunk(ring.rank))
    for i, step in enumerate(steps):
        incoming = bufs[i % 2]
        s, rv = _exchange(ring, outgoing, incoming)
        incoming.add_(chunk(step.recv_chunk(ring.rank)))
        outgoing = incoming
        sent, recv = sent + s, recv + rv
    assert steps[-1].recv_chunk(ring.rank) == ring.rank
    output.copy_(outgoing.view_as(output))
    return sent, recv


def ring_all_gather(output: Tensor, input: Tensor,
                    group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """`output` = concatenation of every rank's `input`, in rank order.

    The all-gather half of the ring with chunks relabelled by -1: rank r starts holding
    chunk r (its own input) and passes finished chunks along N-1 times. `input` may be
    `output`'s own chunk r (ZeRO's gather of the local shard), then no copy is made.
    """
    ring = _ring(group)
    m = input.numel()
    if output.numel() != ring.n * m:
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements, "
                         f"expected {ring.n} x {m}")
    out = _flat(output)
    own = out[ring.rank * m:(ring.rank + 1) * m]
    if not (input.is_contiguous() and input.data_ptr() == own.data_ptr()):
        own.copy_(input.reshape(-1))
    sent = recv = 0
    if ring.n > 1:
        for step in ring_schedule(ring.n, shift=-1):
            if step.phase != ALL_GATHER:
                continue
            out_c, in_c = step.send_chunk(ring.rank), step.recv_chunk(ring.rank)
            s, rv = _exchange(ring, out[out_c * m:(out_c + 1) * m], out[in_c * m:(in_c + 1) * m])
            sent, recv = sent + s, recv + rv
    if not output.is_contiguous():  # out was a copy
        output.copy_(out.view_as(output))
    return sent, recv


def ring_all_to_all(output: Tensor, input: Tensor, output_splits: list[int],
                    input_splits: list[int],
                    group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Rank r sends `input`'s piece d to rank d and receives rank s's piece r into
    `output`'s piece s (torch's `all_to_all_single` semantics, uneven splits allowed).

    Not a ring but the pairwise exchange: in step s = 1..N-1 rank r sends its piece for
    r+s and receives the piece from r-s, so every byte crosses the wire once, straight to
    its owner. A true ring would forward each piece N/2 hops on average, sending (N-1)/2
    times more for nothing. Both sides of each message know its size (what r sends to d
    is what d expects from r), so empty pieces are skipped on both.
    """
    ring = _ring(group)
    out = _flat(output)
    outs = list(out.split(output_splits))
    ins = list(_flat(input).split(input_splits))
    if len(outs) != ring.n or len(ins) != ring.n:
        raise ValueError(f"ring_all_to_all needs {ring.n} input and output splits")
    r, n = ring.rank, ring.n
    outs[r].copy_(ins[r])
    sent = recv = 0
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        a, b = _sendrecv(ins[dst], _peer(group, n, dst), outs[src], _peer(group, n, src), group)
        sent, recv = sent + a, recv + b
    if not output.is_contiguous():  # out was a copy
        output.copy_(out.view_as(output))
    return sent, recv
