"""The shape of a run, as the memory formulas need it: one value, built once.

`RunShape` holds what decides a rank's bytes — the flat buffers' sizes, the world, the
bytes per parameter, which model states the strategy shards and offloads (its own
declarations, `Strategy.shards` / `offloads`), the largest unit and widest parameter,
the in-flight reductions, prefetch and the device's allocator behaviour. `zero.run_shape`
builds it from a config and a (meta) model by the strategy's own cut; the engine
(`Engine.memory_phases`) and `zerotrain estimate` both hand it to `phase_estimates`.

It holds numbers only, never tensors: the predictions it feeds are what the audit of the
live tensors is checked against, so they must not be read from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotrain.memory.states import (
    STAGE_SHARDS,
    BytesPerParam,
    declared_offloads,
    offload_problem,
    tier_of,
)


@dataclass(frozen=True)
class RunShape:
    buffer_numels: tuple[int, ...]  # each unit's flat buffer (before padding to N)
    world: int
    bpp: BytesPerParam
    shards: frozenset[str] = frozenset()
    offloads: frozenset[str] = frozenset()  # kept off the device between uses
    disk: frozenset[str] = frozenset()      # of those, kept in files (nvme); else host
    largest_unit: int = 0       # elements of the largest unit (gathered whole at ZeRO-3)
    widest_param: int = 0       # elements of the largest parameter (autograd's fresh grad)
    reduce_bytes: int = 4       # bytes per element of a gradient on the wire
    gather_bytes: tuple[int, ...] = ()  # ZeRO-3: each unit's gathered bytes as its wire
    #                              sends them (zero/params/wire.py); empty: params' bytes
    in_flight: int = 2          # reductions running during backward
    prefetch: bool = True       # ZeRO-3 gathers the next unit ahead
    high_water: bool = False    # a CPU process: resident set as a running maximum
    lazy_grads: bool = False    # a CPU process: never-written pages are not resident
    init_piece: int | None = None  # ZeRO-3 per-name init: elements drawn at once
    runtime: int = 0            # bytes the first step adds for good (a compiled optimizer)
    retention: float = 0.0      # the CPU allocator's allowance, a fraction
    offload_prefetch: int = 1   # offload tiers: units read ahead of the one in use
    micro_steps: int = 1        # micro-batches per optimizer step (gradient accumulation)
    tier_io: int = 0            # the disk tier's block-I/O buffers (threads × block), bytes
    update_temp: int = 0        # bytes per updated element the update allocates and frees
    secondary_partition: int = 0  # ZeRO++ hpZ: each unit's 1/K kept from forward to backward
    grad_wire_bits: int = 0     # ZeRO++ qgZ: gradients cross nodes as 8- or 4-bit codes
    stage: int = field(default=0, compare=False)  # for messages only; formulas read shards

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world}")
        why = offload_problem(self.shards, self.offloads, self.disk)
        if why is not None:
            raise ValueError(why)
        if self.offload_prefetch < 0 or self.micro_steps < 1:
            raise ValueError("offload_prefetch must be >= 0 and micro_steps >= 1")
        if any(n < 0 for n in self.buffer_numels):
            raise ValueError("buffer sizes must be >= 0")

    @classmethod
    def for_stage(cls, buffer_numels, world: int, stage: int, bpp: BytesPerParam, *,
                  offload: bool | str = False, offload_param: str = "none",
                  **fields) -> RunShape:
        """A shape by stage number (SPEC §6's table), for callers without a strategy.
        `offload`: the optimizer's tier (True: cpu), `offload_param` the parameters'."""
        if stage not in STAGE_SHARDS:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
        opt = offload if isinstance(offload, str) else "cpu" if offload else "none"
        offloads, disk = declared_offloads(opt, offload_param)
        return cls(tuple(buffer_numels), world, bpp, STAGE_SHARDS[stage], offloads,
                   disk, stage=stage, **fields)

    @property
    def offload(self) -> bool:
        return bool(self.offloads)

    def tier(self, state: str) -> str:
        """device, host or disk: where `state` (one of memory.FIELDS) lives between uses."""
        return tier_of(state, self.offloads, self.disk)
