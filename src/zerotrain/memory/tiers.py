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
  the device for its use (one unit: with parameters off the device the gather waits for
  the tier's read, and it is that read which runs ahead, not a second gather).
- **what the tiers hold in memory** (`tier_buffers`, per phase; the engine's residency,
  zero/states/disk.py): a tensor in a tier is brought into its own storage when fetched
  and released when its write has landed, so beyond the states that stay in memory a
  rank holds, with w = max(1, p) writes in flight behind:
  - *init* — the unit being built: its parameter shard U·b_p (parameters off the
    device) and, for an optimizer on disk with a master of its own, the master U·b_m,
    before they go to their tier (each unit is sent before the next is built);
  - *forward* — parameters off the device: the p shards read ahead (or, with p = 0, the
    one being gathered), max(1, p)·U·b_p;
  - *backward* — forward's, or, with gradients on disk, at a unit's reduction: the p
    shards read ahead, the gradient shard landing and w written behind,
    p·U·b_p + (1 + w)·U·b_g (the unit's own shard is released once gathered);
  - *step* — an optimizer on disk streams units: the one updating, p read ahead and the
    last one until its write lands, (p + 2)·U·(b_m + K) (b_m: the parameter values when
    the shard is the master), their gradient shards (on disk) but the last one's, which
    is dropped once used, (p + 1)·U·b_g, and the update's transient (Adam's denominator:
    `update_temp` bytes per element of a unit); parameters off the device with a master
    elsewhere: the shard each update publishes, written behind, (1 + w)·U·b_p;
  - *I/O buffers* — the disk tier's block buffers (`tier_io`: O_DIRECT's bounce buffer of
    each I/O thread), held from its first move on.
  U·n above stands for the n largest units' shards together (`_largest_shards`): an
  upper bound whatever the order the units come in. So is the read-ahead: a read
  still in flight holds only the blocks that have landed.
  `staging_bytes` is the largest of these in each memory (on a GPU the parameter shards
  are the device's — fetched into their own storage there — and the rest the host's).
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

import math
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
    bf16-pure) the parameter values it updates; with Kahan its compensation too."""
    return (shape.bpp.master or shape.bpp.params) + shape.bpp.comp


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
                       math.ceil(s * (_master_bytes(shape) + bpp.optimizer))),
                  Move("optimizer states out", "host", "disk",
                       math.ceil(s * (own + bpp.comp + bpp.optimizer)))]
    home = "device" if o_tier == "device" else "host"  # where the update runs
    if home != p_tier:
        moves.append(Move("params (after step)", home, p_tier, s * bpp.params))
    return TierTraffic(moves)


def _largest_shards(shape: RunShape, n: int) -> int:
    """Elements of the n largest units' shards together: what n units held at once cost
    at most, whatever their order (0 when the parameters are not sharded). A buffer
    larger than the largest unit (an estimate's Ψ in one buffer) stands for units of at
    most the largest unit's size."""
    big = shape.largest_unit
    if "params" not in shape.shards or n <= 0 or big <= 0:
        return 0
    pieces: list[int] = []
    for b in shape.buffer_numels:
        pieces += [shard_numel(big, shape.world)] * min(n, b // big)
        pieces.append(shard_numel(b % big, shape.world))
    return sum(sorted(pieces, reverse=True)[:n])


def tier_buffers(shape: RunShape) -> dict[str, tuple[int, int]]:
    """What the tiers hold in memory per rank at each phase's peak beyond the states that
    stay in memory, {phase: (parameter side, state side)} for init, forward, backward and
    step — on a GPU the parameter shards are the device's, the rest the host's — and
    `io`, (0, the disk tier's I/O buffers) held from the first move on (module doc)."""
    bpp, p = shape.bpp, shape.offload_prefetch
    w = max(1, p)  # writes in flight behind (a buffer is released once w newer started)

    def units(n: int) -> int:
        return _largest_shards(shape, n)

    params_move = shape.tier("params") != "device"
    streamed = shape.tier("optimizer") == "disk"  # the optimizer's units stream from disk
    grads_disk = shape.tier("grads") == "disk"
    # the parameter shard is the master (no master dtype, one tier): written once, as it
    shared = bpp.master == 0 and shape.tier("params") == shape.tier("optimizer")
    own_master = streamed and not shared
    ahead = units(p) * bpp.params if params_move else 0  # the shards read ahead
    forward = max(ahead, units(1) * bpp.params * params_move)  # or the one being gathered
    # with gradients on disk the peak is a unit's reduction: its gradient shard landing,
    # w written behind and the shards ahead (its own shard was released once gathered;
    # (1 + w)·b_g ≥ b_p, so this moment is never below the gather's)
    backward = (ahead, units(1 + w) * bpp.grads) if grads_disk else (forward, 0)
    step = 0
    if streamed:
        step = (math.ceil(units(p + 2) * (_master_bytes(shape) + bpp.optimizer))
                + units(p + 1) * bpp.grads * grads_disk + units(1) * shape.update_temp)
    return {"init": (units(1) * bpp.params * params_move,
                     units(1) * _master_bytes(shape) * own_master),
            "forward": (forward, 0), "backward": backward,
            "step": (units(1 + w) * bpp.params if params_move and not shared else 0, step),
            "io": (0, shape.tier_io if shape.disk else 0)}


def staging_bytes(shape: RunShape) -> dict[str, int]:
    """The tiers' buffers at their largest, by memory tier (module doc): the parameter
    shards on the device, the rest (and the disk tier's I/O buffers) in host memory."""
    b = tier_buffers(shape)
    phases = [b[k] for k in ("init", "forward", "backward", "step")]
    return {"device": max(d for d, _ in phases), "host": max(h for _, h in phases) + b["io"][1]}


def shape_state_bytes(shape: RunShape, *, pad_full: bool = False) -> MemoryEstimate:
    """`state_bytes` of a run's shape, its tiers' buffers included."""
    est = state_bytes(shape.buffer_numels, shape.world, shape.shards, shape.offloads,
                      shape.bpp, largest_unit=shape.largest_unit if "params" in shape.shards
                      else 0, pad_full=pad_full, disk=shape.disk)
    est.staging = staging_bytes(shape)
    return est
