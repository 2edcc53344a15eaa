"""ZeRO++'s qwZ: a unit's parameters gathered as block-quantised int8 with fp32 scales.

Each rank encodes its own shard (`numerics.wire_quant`: one scale per block of 256
elements, blocks inside the shard, so no scale is shared between ranks and no extra
collective is needed); one uint8 all-gather moves every rank's codes and scales; every
rank decodes all chunks — its own included — so all ranks compute on the same values.
The gathered weights are the quantise → dequantise of the shards: within
absmax(block) / 254 of the exact weights, element by element. The masters, the update
and the shards themselves stay exact; only what the forward and backward see is rounded.

Encoded once per step after the update (`refresh`); the receive buffer exists only
while a gather lands.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.numerics.wire_quant import decode, encode, encoded_bytes
from zerotrain.zero.flat import FlatUnit

BITS = 8


class Int8Wire:
    """One unit's send buffer (this rank's encoded shard) and its gather."""

    def __init__(self, unit: FlatUnit):
        self.unit = unit
        self.chunk_bytes = encoded_bytes(unit.shard_numel, BITS)
        self.send = torch.zeros(self.chunk_bytes, dtype=torch.uint8)
        self.recv: Tensor | None = None
        self.lazy = False  # the shard lives in a tier: packed at the gather (`ready`)

    def note(self, shard: Tensor) -> None:
        """The FP8 wire's hook at the publish; the codes need nothing noted."""

    def ready(self, shard: Tensor) -> None:
        """Lazy (tier): encode the shard the tier has just made ready for a gather."""
        if self.lazy:
            self.pack(shard)

    def pack(self, shard: Tensor) -> None:
        self.send = self.send.to(shard.device)
        encode(shard, BITS, out=self.send)

    def start(self, comm: Comm, async_op: bool) -> Handle:
        self.recv = torch.empty(self.unit.world_size * self.chunk_bytes, dtype=torch.uint8,
                                device=self.send.device)
        return comm.all_gather(self.recv, self.send, async_op=async_op)

    def unpack(self, params: Tensor) -> None:
        assert self.recv is not None
        s, b = self.unit.shard_numel, self.chunk_bytes
        for r in range(self.unit.world_size):
            decode(self.recv[r * b:(r + 1) * b], s, BITS, params.dtype,
                   out=params[r * s:(r + 1) * s])
        self.recv = None
