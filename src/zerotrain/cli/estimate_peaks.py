"""`zerotrain estimate`'s predicted peaks per rank: the shape the engine cuts, each phase's
bytes, and the baseline (split from estimate.py, which prints them and fits --max-seq by
them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerotrain.memory import (
    CPU_BASELINE_BYTES,
    config_activations,
    phase_estimates,
    steady_peak,
)

if TYPE_CHECKING:
    from zerotrain.config import Config


def predict_peaks(cfg: Config, world: int, stage: int, offload: bool | str = False, *,
                  device: str = "cpu", micro_batch: int | None = None,
                  seq: int | None = None, offload_param: str = "none") -> dict[str, Any]:
    """A run of `cfg` at this stage, per rank: each phase's bytes above the process's
    baseline (`memory.phase_estimates`, fed with the flat buffers the engine cuts, by the
    engine's own functions) and the init and steady peaks including the baseline.
    `offload`: the optimizer's tier (True: cpu); `offload_param`: the parameters'.

    device "cpu": resident memory as the OS counts it (the CPU runtime's baseline,
    allocator retention, a high-water mark); "cuda": what the allocator counts.
    bench/capacity.py holds these numbers against measured runs.
    """
    cfg, shape = _row_shape(cfg, world, stage, offload, device, offload_param)
    act = config_activations(cfg, micro_batch, seq, device=device).peak
    phases = phase_estimates(shape, act)
    base = CPU_BASELINE_BYTES if device == "cpu" else 0
    return {"phases": phases, "baseline": base, "init": base + phases["init"],
            "steady": base + steady_peak(phases), "device": device,
            "optimizer_compiled": shape.runtime > 0,
            "buffer_numels": list(shape.buffer_numels)}


def peak_at(cfg: Config, world: int, stage: int, offload: bool | str = False, *,
            device: str = "cpu", micro_batch: int | None = None,
            offload_param: str = "none") -> Callable[[int], int]:
    """seq -> the larger of `predict_peaks`' init and steady peaks at that length (the
    shape is cut once)."""
    cfg, shape = _row_shape(cfg, world, stage, offload, device, offload_param)
    base = CPU_BASELINE_BYTES if device == "cpu" else 0

    def peak(seq: int) -> int:
        phases = phase_estimates(shape, config_activations(cfg, micro_batch, seq,
                                                           device=device).peak)
        return base + max(phases["init"], steady_peak(phases))
    return peak


def _row_shape(cfg: Config, world: int, stage: int, offload: bool | str, device: str,
               offload_param: str) -> tuple[Config, Any]:
    from zerotrain.models import build_model, plan_for
    from zerotrain.zero import run_shape, strategy_class

    opt = offload if isinstance(offload, str) else "cpu" if offload else "none"
    cfg = cfg.model_copy(update={"zero": cfg.zero.model_copy(update={
        "stage": stage, "offload_optimizer": opt, "offload_param": offload_param})})
    model = build_model(cfg.model, device="meta")
    return cfg, run_shape(strategy_class(cfg.zero), cfg, model, plan_for(model), device,
                          world)
