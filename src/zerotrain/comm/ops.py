"""The collectives as data: one row per operation, run by `Comm._collective`.

Each row says how torch.distributed runs it (`native`, always asynchronously: a
synchronous call is an asynchronous one waited for), how zerotrain's own point-to-point
version in `ring.py` runs it (None: native only), and the bytes the native one moves, which
the backend does not report: a ring's standard factor ((N-1)/N of the buffer per
reduce-scatter or all-gather pass), or the exact payload to other ranks for the all-to-all
and the scatter. Adding a collective is adding a row here and a method on `Comm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from zerotrain.comm.ring import (
    ring_all_gather,
    ring_all_reduce,
    ring_all_to_all,
    ring_reduce_scatter,
)


@dataclass(frozen=True)
class Op:
    """One collective: how torch runs it, how zerotrain's ring runs it, what it moves.

    native(out, inp, group, **kw) -> Work; ring(out, inp, group, **kw) -> (sent, recv)
    observed, or None for native only; traffic(world, rank, out, inp, **kw) -> (sent,
    recv) the native one moves (computed); numel(out, inp): the size every rank agrees
    on (the lockstep fingerprint); auto_ring: `auto` picks the ring for large buffers on
    gloo (not for all-reduce: gloo's own beats the ring's two passes).
    """

    native: Callable[..., object]
    ring: Callable[..., tuple[int, int]] | None
    traffic: Callable[..., tuple[float, float]]
    numel: Callable[[Tensor, Tensor], int]
    auto_ring: bool = False
    counted_as: str | None = None  # the counter's name, when not the op's own


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _pass(n: int) -> float:
    """One reduce-scatter or all-gather pass of a ring moves (N-1)/N of the buffer."""
    return (n - 1) / n


def _nat_all_reduce(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None,
                    reduce: dist.ReduceOp = dist.ReduceOp.SUM) -> object:
    return dist.all_reduce(out, op=reduce, group=group, async_op=True)


def _nat_reduce_scatter(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> object:
    """torch's single-tensor reduce-scatter under its current name (renamed in 2.x)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def _nat_all_gather(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> object:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _nat_all_to_all(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None,
                    out_splits: list[int], in_splits: list[int]) -> object:
    """Pieces are in elements of the flattened tensors (torch splits dimension 0), so
    `out` must be contiguous; `inp` may be anything."""
    return dist.all_to_all_single(out.view(-1), inp.reshape(-1), out_splits, in_splits,
                                  group=group, async_op=True)


def _nat_scatter(out: Tensor, inp: Tensor | None, group: dist.ProcessGroup | None,
                 inputs: list[Tensor] | None, src: int) -> object:
    root = dist.get_global_rank(group, src) if group is not None else src
    return dist.scatter(out, inputs, src=root, group=group, async_op=True)


def _a2a_bytes(n: int, rank: int, out: Tensor, inp: Tensor, out_splits: list[int],
               in_splits: list[int]) -> tuple[float, float]:
    """Exactly the pieces for (from) other ranks: the one kept is never sent."""
    size = inp.element_size()
    return ((sum(in_splits) - in_splits[rank]) * size,
            (sum(out_splits) - out_splits[rank]) * size)


def _scatter_bytes(n: int, rank: int, out: Tensor, inp: Tensor | None,
                   inputs: list[Tensor] | None, src: int) -> tuple[float, float]:
    return (nbytes(out) * (n - 1), 0) if rank == src else (0, nbytes(out))


def _ar_bytes(n: int, rank: int, out: Tensor, inp: Tensor, **kw: object) -> tuple[float, float]:
    moved = 2 * _pass(n) * nbytes(out)
    return moved, moved


OPS: dict[str, Op] = {
    "all_reduce": Op(_nat_all_reduce, lambda o, i, g: ring_all_reduce(o, g), _ar_bytes,
                     lambda o, i: o.numel()),
    "reduce_scatter": Op(
        _nat_reduce_scatter, ring_reduce_scatter,
        lambda n, r, o, i: (_pass(n) * nbytes(i),) * 2, lambda o, i: i.numel(),
        auto_ring=True),
    "all_gather": Op(
        _nat_all_gather, ring_all_gather,
        lambda n, r, o, i: (_pass(n) * nbytes(o),) * 2, lambda o, i: o.numel(),
        auto_ring=True),
    "all_to_all": Op(_nat_all_to_all,
                     lambda o, i, g, out_splits, in_splits:
                     ring_all_to_all(o, i, out_splits, in_splits, g),
                     _a2a_bytes, lambda o, i: i.numel()),
    "scatter": Op(_nat_scatter, None, _scatter_bytes, lambda o, i: o.numel()),
    "all_reduce_scalars": Op(_nat_all_reduce, None, _ar_bytes, lambda o, i: o.numel(),
                             counted_as="all_reduce"),
}
