"""Peak memory per phase of a run, predicted: init, forward, backward, step, save.

What a rank holds at each phase's peak, above the process's baseline (the framework
itself: `CPU_BASELINE_BYTES` on a CPU rank), from the same model-state formulas as the
ZeRO table plus what each phase adds. The engine measures the same phases
(`PhasePeaks`); `zerotrain estimate --model` prints the init and steady peaks, and
`bench/capacity.py` holds both against runs of 100M–1B parameters. The terms:

- **model states** — parameters, gradients, master copies and optimizer states per rank
  (`model_state_bytes_from_buffers`, flat buffers padded to a multiple of N). The
  optimizer's states do not exist before the first `step()` (optimizers create them
  lazily), so init holds everything but them; every later phase holds them all.
- **init** — the model is materialised one unit at a time (a meta-device model), its
  initial values drawn in place into the unit's buffer (models/init.py): ZeRO-3 holds
  one unit's full buffer while it cuts the shard (`largest_unit`), or, when the plan's
  per-name rule gives the values, only the parameter being drawn (`init_piece`: each is
  drawn whole into one scratch buffer and its owned slice kept); stages 0-2 keep their
  buffers, nothing transient. Stages 2-3 never zero their gradient shard (each backward's
  first reduction overwrites it), so on a CPU its pages become resident only at the first
  backward (`lazy_grads`: untouched pages are not resident). On CUDA there are no lazy
  pages: the caching allocator hands out every block whole, so the gradient shard counts
  at init, and so does the per-parameter path's empty full-unit buffer (made for the
  first gather to fill, released at once, reused unit after unit): its CUDA init bound
  is Σ(shard + master + gradient shard) + the widest parameter + the largest unit.
- **offload tiers** — states in files on disk (nvme) are in no memory; what the tiers
  bring into memory in each phase (`memory.tiers.tier_buffers`: the unit being built at
  init, the parameter shards read ahead in forward and backward, the gradient shards
  written behind, the optimizer units streamed in the step) adds to that phase, the disk
  tier's I/O buffers to every phase. Saving streams the disk-resident states file to
  file (nothing more in memory).
- **gathered units** (ZeRO-3) — the running unit and, with prefetch, the next one; with
  the parameters off the device only the running one (the tier's reads run ahead).
- **activations** — saved for backward (`activation_bytes`); the caller counts them.
- **bucket pool** (stages 2–3) — a unit's gradients land in a full-size bucket of the
  reduce dtype; up to `in_flight` reductions are in flight while the next bucket fills,
  and a retired bucket goes back to a pool (one list per bucket size, up to `in_flight + 1`
  each) instead of to the allocator, so later backwards reuse warm pages. The pool is what
  the first backward allocated (`bucket_pool_numel` replays it) and it stays for the rest
  of the run: every phase after the first backward holds it.
- **backward transient** — autograd computes each weight gradient into a fresh tensor
  before adding it into the bucket or `.grad`: one `largest_param` in the gradient dtype.
- **runtime** — resident memory a process gains for good at its first step beyond the
  tensors: the compiled optimizer's inductor runtime (`COMPILE_RUNTIME_BYTES`, when
  `optimizer.compile` resolves true).
- **save** — one serialised copy of this rank's checkpoint tensors (safetensors turns
  every tensor into bytes before writing): its shard at every stage (stage 0's ranks
  split the writing of the replicated state).
- **allocator retention** (`retention`, a fraction, CPU only) — glibc serves blocks under
  its mmap threshold (dynamic, at most 32 MiB) from heaps it keeps after they are freed;
  activations, per-parameter gradients and collective staging buffers of that size leave
  freed but resident memory behind. Not a tensor anyone holds, so no formula counts it;
  `CPU_RETENTION` is the measured allowance (see its comment), applied to the bytes above
  the baseline of every phase after init.

Steady state = the largest of forward, backward and step: from the second step on, the
phases repeat with every term present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zerotrain.memory.shape import RunShape
from zerotrain.memory.states import shard_numel
from zerotrain.memory.tiers import shape_state_bytes, tier_buffers

PHASES = ("init", "forward", "backward", "step", "save")
STEADY = ("forward", "backward", "step")

#: Resident memory of a CPU rank before the engine exists: the torch runtime, the gloo
#: process group and zerotrain's imports. Measured by bench/capacity.py (torch 2.13 CPU,
#: Python 3.11, 2 gloo ranks): 0.356–0.358 GiB at the engine's start on every run.
CPU_BASELINE_BYTES = 366 * 2**20
#: What `torch.compile` of the optimizer leaves resident after its first step (imports,
#: the compiled kernel, inductor's caches). Measured: +70 MiB for good, +32 MiB transient,
#: one AdamW step on a 30M-element tensor compiled vs eager (same process, torch 2.13 CPU).
COMPILE_RUNTIME_BYTES = 96 * 2**20
#: Allocator retention on CPU as a fraction of the bytes above the baseline (steady
#: phases). Measured at 340M parameters, 2 ranks: default glibc peak minus the peak with
#: `MALLOC_MMAP_THRESHOLD_=131072` (every large block returned to the OS): stage 0 +6.0 %,
#: ZeRO-2 +7.9 %, ZeRO-3 +2.7 % of the steady peak.
CPU_RETENTION = 0.05


def bucket_pool_numel(numels: Sequence[int], world: int, in_flight: int = 2) -> int:
    """Elements of the gradient buckets a ZeRO-2/3 backward leaves in its pool.

    Replays one backward over the units in reduction order: a unit's bucket is taken
    from the pool (same padded size) or newly allocated; once more than `in_flight`
    reductions are pending the oldest retires and its bucket returns to the pool. The
    pool keeps up to `in_flight + 1` spares per size (`ShardedGrads.release`), and no
    more than `in_flight + 1` buckets are ever alive at once, so it never has to drop
    one: what the replay allocates is the pool, held for the rest of the run.
    """
    spare: dict[int, int] = {}
    made = 0
    pending: list[int] = []
    for n in numels:
        size = world * shard_numel(n, world)
        if spare.get(size):
            spare[size] -= 1
        else:
            made += size
        pending.append(size)
        if len(pending) > in_flight:
            old = pending.pop(0)
            spare[old] = spare.get(old, 0) + 1
    return made


def phase_estimates(shape: RunShape, activations: int = 0) -> dict[str, int]:
    """Bytes above the baseline at each phase's peak, per rank (device and host together,
    as one CPU process sees them), for a run of this shape (memory/shape.py) plus the
    `activations` its caller counts. What each field of the shape adds:
    `widest_param`, autograd's fresh gradient in backward; `runtime`, resident bytes the
    first step adds for good (`COMPILE_RUNTIME_BYTES` when the optimizer is compiled);
    `retention`, the allocator's allowance (`CPU_RETENTION` for a CPU process);
    `high_water`, the running maximum over the phases in order — what a resident-set
    high-water mark measures on CPU, where freed memory usually stays with the process;
    `lazy_grads`, memory never written is not resident (a CPU process): the sharded
    gradient at init, and ZeRO-3's empty full-unit buffer; `init_piece`, elements ZeRO-3
    materialises at once during init — a whole unit by default, the largest parameter
    when the plan's per-name rule draws each parameter into the shard; without lazy pages
    (CUDA) that path also holds one empty unit buffer, so its init adds `largest_unit`."""
    sh, bpp, world, numels = shape, shape.bpp, shape.world, shape.buffer_numels
    params_sharded, grads_sharded = "params" in sh.shards, "grads" in sh.shards
    largest_unit = sh.largest_unit if params_sharded else 0
    est = shape_state_bytes(sh, pad_full=True)  # what is on disk is not in memory
    optimizer = est.device["optimizer"] + est.host["optimizer"]
    states = sum(est.device.values()) + sum(est.host.values())
    tiers = {k: sum(v) for k, v in tier_buffers(sh).items()}  # one memory: both sides
    ahead = sh.prefetch and sh.tier("params") == "device"  # else the tier reads ahead
    gathered = (2 if ahead else 1) * largest_unit * bpp.params
    if params_sharded and sh.secondary_partition:  # hpZ: every unit's 1/K, forward to backward
        gathered += sum(world * shard_numel(n, world) for n in numels) \
            // sh.secondary_partition * bpp.params
    pool = (bucket_pool_numel(numels, world, sh.in_flight) * sh.reduce_bytes
            if grads_sharded else 0)
    held = states + pool + sh.runtime + tiers["io"]  # from the first backward/step on
    shard = sum(shard_numel(n, world) for n in numels)
    if not sh.shards:  # a rank writes only its shard of the replicated state (write_range)
        saved = math.ceil((bpp.optimizer + (bpp.master or bpp.params) + bpp.comp) * shard)
    else:
        saved = est.host["master"] + est.device["master"] + optimizer
        if bpp.master == 0 and sh.tier("params") == sh.tier("optimizer") != "disk":
            saved += bpp.params * shard  # fp32: this rank's parameters are its master
    grads = est.device["grads"] + est.host["grads"] if sh.lazy_grads and grads_sharded else 0
    if not params_sharded:
        drawn = 0
    elif sh.init_piece is None:  # each unit materialised whole, then cut
        drawn = largest_unit
    else:  # the scratch parameter, plus (no lazy pages) the unit's empty full buffer
        drawn = sh.init_piece + (0 if sh.lazy_grads else largest_unit)
    live = {
        "init": states - optimizer - grads + drawn * bpp.params + tiers["init"] + tiers["io"],
        "forward": held + gathered + activations + tiers["forward"],
        "backward": (held + gathered + activations + sh.widest_param * bpp.grads
                     + tiers["backward"]),
        "step": held + tiers["step"],
        "save": held + saved,
    }
    live = {k: v if k == "init" else int(v * (1 + sh.retention)) for k, v in live.items()}
    if not sh.high_water:
        return live
    out, top = {}, 0
    for phase in PHASES:  # what a process's high-water mark shows: never below earlier peaks
        top = max(top, live[phase])
        out[phase] = top
    return out


def steady_peak(phases: dict[str, int]) -> int:
    """The steady-state peak of a run: the largest of its forward, backward and step."""
    return max(phases[p] for p in STEADY if p in phases)
