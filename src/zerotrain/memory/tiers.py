"""The offload tiers (ZeRO-Offload, ZeRO-Infinity): what lives where, and the bytes moved.

A run's shape declares which model states are off the device (`RunShape.offloads`) and
which of those are in files on a disk (`RunShape.disk`; the rest are in host memory):
`zero.offload_param` moves the parameter shard, `zero.offload_optimizer` the master and
the moments (nvme) and, with them, the gradient shard (to host memory beside a GPU: it
is written every micro-step and read by the update, which runs on the host; on a
CPU-only run to the disk, written every micro-step and read back A times — by each
later micro-step to accumulate and by the update).

Per rank, S = Σ ceil(P/N) elements (the shard of every flat buffer), U = ceil(L/N) the
largest unit's shard, A micro-steps per optimizer step, p = `offload_prefetch`, and
bytes per element b_p (parameters), b_g (gradients), b_m (master; 0 in fp32 and
bf16-pure: the optimizer then updates a param-dtype copy, b_p), K (moments):

- **where**: each state in its tier (`state_bytes`); a ZeRO-3 unit is still gathered on
  the device for its use. Read/write buffers (`staging_bytes`), in host memory: for
  parameters on disk, (1 + p) unit shards U·b_p (the unit in use and p read ahead; the
  host-to-device copy lands in the gathered unit's own slot, so the device needs no
  buffer of its own); for an optimizer on disk, (1 + p) unit shards of U·(b_m + K) (the
  unit updating and p read ahead; a buffer is refilled once its write-back is done).
- **bytes moved per step** (`tier_traffic`): parameters off the device are fetched for
  every forward and every backward, 2·A·S·b_p read from their tier, and the updated
  shard written back to it once, S·b_p (from wherever the update ran). An offloaded
  optimizer receives the gradient shard every micro-step, A·S·b_g into host memory. An
  optimizer on disk reads its master and moments once per step, S·(b_m + K), and writes
  them back once. In fp32 with parameters and optimizer in one tier the parameter shard
  is the master: it is read with the moments and written back as the parameters.

Arithmetic on the shape's numbers only, never on live tensors: the engine's byte
counters (per tier, per step) are held against `tier_traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotrain.memory.shape import RunShape
from zerotrain.memory.states import TIERS, MemoryEstimate, shard_numel, state_bytes


@dataclass(frozen=True)
class Move:
    """One transfer per step and rank: `nbytes` of `what` from tier `src` to `dst`."""

    what: str
    src: str
    dst: str
    nbytes: int


@dataclass
class TierTraffic:
    """The transfers of one optimizer step on one rank, between device, host and disk."""

    moves: list[Move] = field(default_factory=list)

    def read(self, tier: str) -> int:
        """Bytes that leave `tier` per step."""
        return sum(m.nbytes for m in self.moves if m.src == tier)

    def written(self, tier: str) -> int:
        """Bytes that arrive in `tier` per step."""
        return sum(m.nbytes for m in self.moves if m.dst == tier)

    def per_tier(self) -> dict[str, dict[str, int]]:
        """{tier: {"read": bytes, "written": bytes}} — the engine's I/O counters' keys."""
        return {t: {"read": self.read(t), "written": self.written(t)} for t in TIERS}

    @property
    def host_to_device(self) -> int:
        """Bytes copied onto the device (from host memory or, through it, from disk)."""
        return sum(m.nbytes for m in self.moves if m.dst == "device")

    @property
    def device_to_host(self) -> int:
        return sum(m.nbytes for m in self.moves if m.src == "device")


def _master_bytes(shape: RunShape) -> int:
    """Bytes per element the update reads as its master: the master, or (fp32,
    bf16-pure) the parameter values it updates."""
    return shape.bpp.master or shape.bpp.params


def tier_traffic(shape: RunShape) -> TierTraffic:
    """The bytes each rank moves between its tiers in one optimizer step (module doc)."""
    bpp, a = shape.bpp, shape.micro_steps
    s = sum(shard_numel(n, shape.world) for n in shape.buffer_numels)
    p_tier, g_tier, o_tier = shape.tier("params"), shape.tier("grads"), shape.tier("optimizer")
    moves: list[Move] = []
    if p_tier != "device":
        moves += [Move("params (fwd)", p_tier, "device", a * s * bpp.params),
                  Move("params (bwd)", p_tier, "device", a * s * bpp.params)]
    if g_tier != "device":
        moves.append(Move("grads", "device", g_tier, a * s * bpp.grads))
    if g_tier == "disk":  # read back by each later micro-step (to add) and by the update
        moves.append(Move("grads (read back)", "disk", "host", a * s * bpp.grads))
    if o_tier == "disk":
        # the update runs in host memory; the parameter shard is the master when both
        # share the disk without a master copy: it is written back as the parameters
        own = 0 if bpp.master == 0 and p_tier == o_tier else _master_bytes(shape)
        moves += [Move("optimizer states in", "disk", "host",
                       s * (_master_bytes(shape) + bpp.optimizer)),
                  Move("optimizer states out", "host", "disk", s * (own + bpp.optimizer))]
    home = "device" if o_tier == "device" else "host"  # where the update runs
    if home != p_tier:
        moves.append(Move("params (after step)", home, p_tier, s * bpp.params))
    return TierTraffic(moves)


def staging_bytes(shape: RunShape) -> dict[str, int]:
    """The tiers' read/write buffers per rank, by memory tier (module doc)."""
    unit = shard_numel(shape.largest_unit, shape.world) if "params" in shape.shards else 0
    n = 1 + shape.offload_prefetch
    host = 0
    if shape.tier("params") == "disk":
        host += n * unit * shape.bpp.params
    if shape.tier("optimizer") == "disk":
        host += n * unit * (_master_bytes(shape) + shape.bpp.optimizer)
    if shape.tier("grads") == "disk":  # the shard landing and p written behind
        host += n * unit * shape.bpp.grads
    return {"device": 0, "host": host}


def shape_state_bytes(shape: RunShape, *, pad_full: bool = False) -> MemoryEstimate:
    """`state_bytes` of a run's shape, its tiers' buffers included."""
    est = state_bytes(shape.buffer_numels, shape.world, shape.shards, shape.offloads,
                      shape.bpp, largest_unit=shape.largest_unit if "params" in shape.shards
                      else 0, pad_full=pad_full, disk=shape.disk)
    est.staging = staging_bytes(shape)
    return est
