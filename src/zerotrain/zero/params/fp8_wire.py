"""ZeRO-3's FP8 all-gather: a unit's FP8-linear weights travel as 1 byte per element.

A unit's flat buffer mixes the weights of FP8 linears with parameters that must keep
their precision (norm gains, biases) and with padding. Each rank's shard is packed into
bytes: elements of FP8 weights as E4M3 patterns (`numerics.fp8_gather`), everything else
as its raw bytes; chunks are padded to the longest rank's so one uint8 all-gather moves
them. Each weight has one scale, from the MAX over ranks of its pieces' amaxes — one
small all-reduce per step for the whole model — so every rank dequantises identically
and the gathered weight is the quantise → dequantise of the whole weight. With
power-of-two scales the FP8 layer re-quantising it loses nothing more: under the
tensorwise recipe training computes exactly what it computes without the FP8 gather,
with about half of bf16's parameter traffic.

The bytes are packed once per step (after the update, `Fp8Wire.refresh`); forward and
backward gathers both reuse them. The receive buffer exists only while a gather lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from zerotrain.comm.collectives import Comm, Handle
from zerotrain.numerics.fp8_gather import dequantize, local_amax, quantize_shard
from zerotrain.zero.flat import FlatUnit


@dataclass
class Piece:
    """[start, end) of the unit's flat coordinates, in one rank's chunk, at `byte`."""

    start: int
    end: int
    byte: int
    fp8: str | None  # the FP8 weight's name, or None for raw bytes


class Fp8Wire:
    """The byte layout of one unit's gather, and its send buffer."""

    def __init__(self, unit: FlatUnit, fp8_names: set[str], itemsize: int):
        self.unit, self.itemsize = unit, itemsize
        self.chunks: list[list[Piece]] = [self._layout(r, fp8_names)
                                          for r in range(unit.world_size)]
        self.chunk_bytes = max(sum(self._nbytes(p) for p in c) for c in self.chunks)
        self.send = torch.zeros(self.chunk_bytes, dtype=torch.uint8)
        self.scales: dict[str, Tensor] = {}
        self.recv: Tensor | None = None
        # With a parameter tier (`zero.offload_param`) the shard is away between uses:
        # its amaxes are noted when the publish writes it (`note`), the all-ranks ones
        # kept (`amax`), and the bytes packed at the gather from the shard made ready
        # (`ready`); the send buffer lives only while a gather runs (review 3, C-2).
        self.lazy = False
        self.mine: dict[str, Tensor] = {}
        self.amax: dict[str, Tensor] = {}

    def _nbytes(self, p: Piece) -> int:
        return (p.end - p.start) * (1 if p.fp8 else self.itemsize)

    def _layout(self, rank: int, fp8_names: set[str]) -> list[Piece]:
        lo, hi = rank * self.unit.shard_numel, (rank + 1) * self.unit.shard_numel
        cuts = [(max(lo, s.offset), min(hi, s.end), s.name) for s in self.unit.slots
                if s.name in fp8_names and max(lo, s.offset) < min(hi, s.end)]
        pieces, pos, byte = [], lo, 0
        for a, b, name in cuts:
            for start, end, fp8 in ((pos, a, None), (a, b, name)):
                if end > start:
                    pieces.append(Piece(start, end, byte, fp8))
                    byte += self._nbytes(pieces[-1])
            pos = b
        if hi > pos:
            pieces.append(Piece(pos, hi, byte, None))
        return pieces

    def local_amaxes(self, shard: Tensor) -> dict[str, Tensor]:
        lo = self.unit.shard_range[0]
        return {p.fp8: local_amax(shard[p.start - lo:p.end - lo])
                for p in self.chunks[self.unit.rank] if p.fp8}

    def note(self, shard: Tensor) -> None:
        """Lazy (tier): this rank's amaxes, taken while the publish holds the shard."""
        if self.lazy:
            self.mine = self.local_amaxes(shard)

    def ready(self, shard: Tensor) -> None:
        """Lazy (tier): pack from the shard the tier has just made ready for a gather."""
        if self.lazy:
            self.pack(shard, self.amax)

    def pack(self, shard: Tensor, amaxes: dict[str, Tensor]) -> None:
        """This rank's chunk as bytes, with every weight's all-ranks amax."""
        if self.send.numel() != self.chunk_bytes:  # lazy: released after each gather
            # made where the shard is (no host round trip per gather); a chunk's padding
            # past this rank's pieces is sent but never decoded
            self.send = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=shard.device)
        self.send = self.send.to(shard.device)
        lo = self.unit.shard_range[0]
        scales: dict[str, Tensor] = {}
        for p in self.chunks[self.unit.rank]:
            out = self.send[p.byte:p.byte + self._nbytes(p)]
            src = shard[p.start - lo:p.end - lo]
            if p.fp8:
                _, scales[p.fp8] = quantize_shard(src, amaxes[p.fp8], out=out)
            else:
                out.copy_(src.contiguous().view(torch.uint8))
        # every weight's scale anew, also of weights this rank holds no piece of: their
        # owners encode with this step's amax, so decoding with an older one would put
        # this rank's copy off by a power of two (review 3, W-1)
        for c in self.chunks:
            for p in c:
                if p.fp8 and p.fp8 not in scales:
                    _, scales[p.fp8] = quantize_shard(shard[:0], amaxes[p.fp8])
        self.scales = scales

    def start(self, comm: Comm, async_op: bool) -> Handle:
        n = self.unit.world_size
        self.recv = torch.empty(n * self.chunk_bytes, dtype=torch.uint8,
                                device=self.send.device)
        return comm.all_gather(self.recv, self.send, async_op=async_op)

    def unpack(self, params: Tensor) -> None:
        """The landed bytes of every rank, decoded into the unit's full buffer."""
        assert self.recv is not None
        raw = params.view(torch.uint8)
        for r, chunk in enumerate(self.chunks):
            base = r * self.chunk_bytes
            for p in chunk:
                src = self.recv[base + p.byte:base + p.byte + self._nbytes(p)]
                if p.fp8:
                    dequantize(src, self.scales[p.fp8], params.dtype, out=params[p.start:p.end])
                else:
                    raw[p.start * self.itemsize:p.end * self.itemsize].copy_(src)
        self.recv = None
        if self.lazy:
            self.send = self.send[:0]


def refresh_all(units: list, comm: Comm) -> None:
    """Pack every FP8 unit after an update: one MAX all-reduce of all weights' amaxes."""
    wired = [u for u in units if u.wire is not None]
    local = [u.wire.mine if u.wire.lazy else u.wire.local_amaxes(u.shard) for u in wired]
    names = sorted({n for c in (u.wire.chunks for u in wired) for ch in c for p in ch
                    if (n := p.fp8)})
    # the default for a weight this rank holds no piece of is made where the amaxes
    # are: stack refuses to mix devices (a CPU 0-d tensor is no scalar operand there)
    dev = wired[0].shard.device if wired else comm.device
    zero = torch.zeros((), device=dev)
    flat = torch.stack([next((a[n] for a in local if n in a), zero)
                        for n in names]) if names else torch.zeros(0, device=dev)
    # back on the shards' device once: each piece's scale would otherwise copy its own
    # 0-d amax host to device (pageable: a stream sync per FP8 piece per step)
    glob = comm.all_reduce_scalars(flat.double(), op="max").float().to(dev)
    amax = dict(zip(names, glob))
    for u in wired:
        if u.wire.lazy:  # its shard is in a tier: packed at the gather (`ready`)
            u.wire.amax = amax
        else:
            u.wire.pack(u.shard, amax)
