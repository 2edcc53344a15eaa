"""Peak memory per phase of a run, predicted: init, forward, backward, step, save.

What a rank holds at each phase's peak, above the process's baseline (the framework
itself), from the same model-state formulas as the ZeRO table plus the transient
buffers each phase adds. The engine measures the same phases (`PhasePeaks`), and
`zerotrain estimate` and `bench/capacity.py` print the two side by side.

- init: parameters, gradients and master copies are made; optimizer states do not exist
  yet. ZeRO-3 materialises one unit at a time in full: + the largest unit.
- forward: all model states + activations; ZeRO-3 + the running unit and the prefetched
  next one.
- backward: forward's + the gradient buckets in flight (stages 2–3: up to
  `in_flight + 1` full-size unit buckets in the reduce dtype before the oldest retires).
- step: all model states (the optimizer's temporaries are cache-sized blocks on CPU).
- save: all model states + one serialised copy of this rank's checkpoint tensors
  (safetensors turns every tensor into bytes before writing).
"""

from __future__ import annotations

from collections.abc import Sequence

from zerotrain.memory.states import BytesPerParam, model_state_bytes_from_buffers, shard_numel

PHASES = ("init", "forward", "backward", "step", "save")


def phase_estimates(buffer_numels: Sequence[int], world: int, stage: int, bpp: BytesPerParam,
                    *, offload: bool = False, largest_unit: int = 0, activations: int = 0,
                    reduce_bytes: int = 4, in_flight: int = 2, prefetch: bool = True,
                    high_water: bool = False) -> dict[str, int]:
    """Bytes above the baseline at each phase's peak, per rank (device and host together,
    as one CPU process sees them). `high_water`: the running maximum over the phases in
    order — what a resident-set high-water mark measures on CPU, where freed memory
    usually stays with the process (the allocator keeps it for reuse)."""
    est = model_state_bytes_from_buffers(
        buffer_numels, world, stage, param_bytes=bpp.params, grad_bytes=bpp.grads,
        master_bytes=bpp.master, optim_bytes=bpp.optimizer, offload=offload,
        largest_unit=largest_unit, pad_full=True)
    optimizer = est.device["optimizer"] + est.host["optimizer"]
    states = sum(est.device.values()) + sum(est.host.values())
    unit = largest_unit * bpp.params if stage == 3 else 0
    gathered = (2 if prefetch else 1) * unit
    biggest = max(buffer_numels, default=0)
    buckets = (in_flight + 1) * biggest * reduce_bytes if stage >= 2 else 0
    saved = est.host["master"] + est.device["master"] + optimizer
    if bpp.master == 0 and not offload:  # fp32: this rank's parameters are its master
        owned = [shard_numel(n, world) for n in buffer_numels] if stage else buffer_numels
        saved += bpp.params * sum(owned)
    live = {
        "init": states - optimizer + unit,
        "forward": states + gathered + activations,
        "backward": states + gathered + activations + buckets,
        "step": states,
        "save": states + saved,
    }
    if not high_water:
        return live
    out, top = {}, 0
    for phase in PHASES:  # what a process's high-water mark shows: never below earlier peaks
        top = max(top, live[phase])
        out[phase] = top
    return out
