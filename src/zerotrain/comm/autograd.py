"""Collectives that autograd can see through.

`all_to_all_dims` is sequence parallelism's exchange (Ulysses): a tensor sharded along
one dimension (the sequence) becomes one sharded along another (the heads), and back.
Rank r cuts its tensor into N equal pieces along `scatter_dim`, sends piece d to rank d,
and concatenates the pieces it receives, in rank order, along `gather_dim`. The
backward pass is the same exchange with the two dimensions swapped — the inverse
permutation of the same bytes — so gradients cost exactly what the forward costs, and
both go through `Comm.all_to_all` (byte-counted, ring or native).

`all_to_all_rows` is expert parallelism's exchange (models/moe_parallel.py): rank r
sends rows [sum(send[:d]), sum(send[:d+1])) to rank d, and receives `recv[s]` rows
from rank s, concatenated in rank order. Its backward is the same exchange with the
two split lists swapped. The splits differ by rank, so every rank learns its `recv`
from a small equal-size exchange of counts first (the caller's), and every rank
issues the same collectives whatever the counts — zeros included.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm


def _exchange(comm: Comm, x: Tensor, scatter_dim: int, gather_dim: int,
              purpose: str) -> Tensor:
    n = comm.world_size
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all_to_all_dims: dimension {scatter_dim} of size "
                         f"{x.shape[scatter_dim]} does not split into {n} equal pieces")
    send = torch.stack(x.chunk(n, dim=scatter_dim))  # [n, *piece], contiguous
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, purpose=purpose).wait()
    return torch.cat(recv.unbind(0), dim=gather_dim)  # recv[s]: rank s's piece for us


class Swapped(torch.autograd.Function):
    """An exchange `fn(comm, x, a, b, purpose)` whose backward is the same exchange with
    `a` and `b` swapped (dimensions for `all_to_all_dims`, split lists for
    `all_to_all_rows`): the inverse permutation of the same bytes."""

    @staticmethod
    def forward(ctx, x: Tensor, fn, comm: Comm, a, b, purpose: str) -> Tensor:
        ctx.fn, ctx.comm, ctx.ab, ctx.purpose = fn, comm, (a, b), purpose
        return fn(comm, x, a, b, purpose)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.ab
        return ctx.fn(ctx.comm, grad, b, a, ctx.purpose), None, None, None, None, None


def all_to_all_dims(comm: Comm, x: Tensor, scatter_dim: int, gather_dim: int, *,
                    purpose: str = "sequence") -> Tensor:
    """Reshard `x` from `gather_dim` to `scatter_dim` across `comm`'s ranks
    (differentiable). E.g. [B, T/N, H, D] → [B, T, H/N, D] with scatter_dim=2,
    gather_dim=1; the call with the two swapped undoes it. Every rank calls it with the
    same shapes; a world of one returns `x` itself."""
    if comm.world_size == 1:
        return x
    return Swapped.apply(x, _exchange, comm, scatter_dim, gather_dim, purpose)


def _exchange_rows(comm: Comm, x: Tensor, send: list[int], recv: list[int],
                   purpose: str) -> Tensor:
    row = math.prod(x.shape[1:])
    # grad mode on, as on the comm thread where the ring cuts and fills its views (views
    # made in an autograd forward's no-grad mode may not be written in grad mode)
    with torch.enable_grad():
        x = x.detach().contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all(out, x, [r * row for r in recv], [s * row for s in send],
                        purpose=purpose).wait()
    return out


def all_to_all_rows(comm: Comm, x: Tensor, send: list[int], recv: list[int], *,
                    purpose: str = "experts") -> Tensor:
    """Send `send[d]` consecutive rows of `x` to rank d; receive `recv[s]` rows from
    rank s (differentiable; uneven splits, zeros allowed). Every rank calls it, with
    splits that agree pairwise (rank a's send[b] = rank b's recv[a])."""
    if comm.world_size == 1:
        return x
    return Swapped.apply(x, _exchange_rows, comm, list(send), list(recv), purpose)
