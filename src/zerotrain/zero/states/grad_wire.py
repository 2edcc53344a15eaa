"""How ZeRO's gradient reduce-scatter travels: plain, or ZeRO++'s qgZ.

`PlainGradWire`: one reduce-scatter over every rank, in the reduce dtype.

`QuantGradWire` (`zero.grad_wire: int8 | int4`), hierarchical as ZeRO++ describes it,
for W = N nodes x L ranks per node (`comm.node_size` = L):

1. inside each node, a full-precision reduce-scatter of the bucket re-ordered so that
   local rank l receives the node's sum of the N chunks owned by ranks (n, l), n < N;
2. across nodes, among the N ranks with the same local rank: each node-sum chunk is
   block-quantised (`numerics.wire_quant`, 256 elements per fp32 scale) and sent to its
   owner's node with one all-to-all;
3. the owner decodes the N pieces — its own node's too, so the result does not depend
   on which node a rank sits on — and adds them in fp32, node 0 first.

Result = sum over nodes of decode(encode(node sum)): exactly what `reference_reduce`
computes without any collective; its error against the plain sum is at most
sum_n absmax(block of node n's sum) / (2 * qmax) per element (qmax 127 or 7). Only
bytes between nodes are quantised; with one node nothing is, and the wire is plain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.numerics.wire_quant import decode, encode, encoded_bytes


class PlainGradWire:
    name = "plain"

    def reduce_scatter(self, comm: Comm, out: Tensor, bucket: Tensor) -> Handle:
        """Start the SUM reduce-scatter of `bucket` into `out` (this rank's chunk)."""
        return comm.reduce_scatter(out, bucket, async_op=True)


class QuantGradWire(PlainGradWire):
    def __init__(self, comm: Comm, bits: int):
        """Collective: every rank builds it (it makes the node and cross-node groups)."""
        self.bits, self.name = bits, f"int{bits}"
        self.local = comm.node_size
        self.nodes = comm.world_size // self.local
        self.intra = comm.split(self.local)
        across = [comm.subgroup(list(range(lr, comm.world_size, self.local)))
                  for lr in range(self.local)]
        self.inter = next(g for g in across if g is not None)

    def reduce_scatter(self, comm: Comm, out: Tensor, bucket: Tensor) -> Handle:
        if self.nodes == 1:
            return super().reduce_scatter(comm, out, bucket)
        n_nodes, s = self.nodes, out.numel()
        node_sum = torch.empty(n_nodes * s, dtype=bucket.dtype, device=bucket.device)
        self.intra.reduce_scatter(node_sum, _by_local_rank(bucket, n_nodes, self.local, s))
        piece = encoded_bytes(s, self.bits)
        send = torch.empty(n_nodes * piece, dtype=torch.uint8, device=bucket.device)
        for n in range(n_nodes):
            encode(node_sum[n * s:(n + 1) * s], self.bits, out=send[n * piece:(n + 1) * piece])
        recv = torch.empty_like(send)
        self.inter.all_to_all(recv, send, purpose="grads")
        out.copy_(_sum_decoded(recv, n_nodes, piece, s, self.bits))
        return Handle()


def _by_local_rank(bucket: Tensor, nodes: int, local: int, s: int) -> Tensor:
    """The bucket's chunks (chunk r is rank r's) re-ordered local-rank-major: chunk of
    rank n*local + l goes to position l*nodes + n."""
    return bucket.view(nodes, local, s).transpose(0, 1).reshape(-1)


def _sum_decoded(recv: Tensor, nodes: int, piece: int, s: int, bits: int) -> Tensor:
    total = torch.zeros(s, dtype=torch.float32, device=recv.device)
    for n in range(nodes):
        total += decode(recv[n * piece:(n + 1) * piece], s, bits, torch.float32)
    return total


def reference_reduce(buckets: list[Tensor], local: int, bits: int) -> Tensor:
    """What qgZ gives every rank, computed in one process from every rank's bucket
    (rank order): the whole reduced buffer, each chunk as its owner receives it. The
    node sums are taken in the reduce dtype as a ring inside the node would not be
    guaranteed to: tests compare with a tolerance there and exactly from the codes on."""
    world = len(buckets)
    nodes, s = world // local, buckets[0].numel() // world
    out = []
    for r in range(world):
        acc = torch.zeros(s, dtype=torch.float32)
        for n in range(nodes):
            node = sum(buckets[n * local + i][r * s:(r + 1) * s] for i in range(local))
            acc += decode(encode(node, bits), s, bits, torch.float32)
        out.append(acc)
    return torch.cat(out)


def choose_grad_wire(comm: Comm, shards: frozenset[str], kind: str) -> PlainGradWire:
    """`zero.grad_wire` for a strategy sharding `shards` (qgZ: ZeRO-3, several nodes)."""
    if kind == "plain" or "params" not in shards:
        return PlainGradWire()
    return QuantGradWire(comm, 8 if kind == "int8" else 4)
