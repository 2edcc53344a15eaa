"""The memory and traffic model (docs/design.md §zero), as formulas, plus measurement.

- `states`: model-state bytes per rank for each ZeRO stage (the ZeRO table), the inverse
  question (the largest model that fits).
- `traffic`: bytes each rank sends per step, and α–β time.
- `tiers`: the offload tiers (device, host, disk): what lives where, the tiers' buffers,
  and the bytes moved between them per step (`tier_traffic`).
- `activations`: saved and peak activations of GPT, llama and HF models, checkpointed,
  offloaded and tiled.
- `phases`: peak memory per phase of a run (init, forward, backward, step, save).
- `measure`: what the process holds, and peaks per phase measured from the live run.

Formulas know no model and no optimizer class: sizes and K come in as numbers, and the
engine's measured audit is held against them in the tests. GB = 10^9 bytes.
"""

from zerotrain.memory.activations import (
    Activations,
    activation_bytes,
    activation_parts,
    block_activation_bytes,
    config_activations,
    head_activation_bytes,
    max_seq,
)
from zerotrain.memory.measure import (
    PhasePeaks,
    measured_process_memory,
    proc_status,
    reset_peak_rss,
)
from zerotrain.memory.phases import (
    COMPILE_RUNTIME_BYTES,
    CPU_BASELINE_BYTES,
    CPU_RETENTION,
    PHASES,
    bucket_pool_numel,
    phase_estimates,
    steady_peak,
)
from zerotrain.memory.shape import RunShape
from zerotrain.memory.states import (
    FIELDS,
    OFFLOADED,
    PRECISIONS,
    STAGE_SHARDS,
    TIERS,
    BytesPerParam,
    MemoryEstimate,
    activation_dtype_bytes,
    bytes_per_param,
    can_offload,
    declared_offloads,
    estimate,
    max_params,
    model_state_bytes,
    model_state_bytes_from_buffers,
    muon_state_bytes,
    offload_problem,
    precision_bytes,
    shard_numel,
    state_bytes,
    tier_of,
)
from zerotrain.memory.tiers import (
    Move,
    TierTraffic,
    shape_state_bytes,
    staging_bytes,
    tier_traffic,
)
from zerotrain.memory.traffic import (
    CollectiveCost,
    Traffic,
    collective_cost,
    collective_traffic,
    muon_mean_traffic,
    muon_traffic,
    node_traffic,
    shape_traffic,
    traffic_per_step,
)

__all__ = [
    "COMPILE_RUNTIME_BYTES",
    "CPU_BASELINE_BYTES",
    "CPU_RETENTION",
    "FIELDS",
    "OFFLOADED",
    "PHASES",
    "PRECISIONS",
    "STAGE_SHARDS",
    "TIERS",
    "Activations",
    "BytesPerParam",
    "CollectiveCost",
    "MemoryEstimate",
    "Move",
    "PhasePeaks",
    "RunShape",
    "TierTraffic",
    "Traffic",
    "activation_bytes",
    "activation_dtype_bytes",
    "activation_parts",
    "block_activation_bytes",
    "bucket_pool_numel",
    "bytes_per_param",
    "can_offload",
    "collective_cost",
    "collective_traffic",
    "config_activations",
    "declared_offloads",
    "estimate",
    "head_activation_bytes",
    "max_params",
    "max_seq",
    "measured_process_memory",
    "model_state_bytes",
    "model_state_bytes_from_buffers",
    "muon_mean_traffic",
    "muon_state_bytes",
    "muon_traffic",
    "node_traffic",
    "offload_problem",
    "phase_estimates",
    "precision_bytes",
    "proc_status",
    "reset_peak_rss",
    "shape_state_bytes",
    "shape_traffic",
    "shard_numel",
    "staging_bytes",
    "state_bytes",
    "steady_peak",
    "tier_of",
    "tier_traffic",
    "traffic_per_step",
]
