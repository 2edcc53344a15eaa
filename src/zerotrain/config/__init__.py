"""One typed configuration tree for everything a run needs.

Loaded from YAML/JSON, then overridden from the command line with dotted keys
(`--optimizer.lr 3e-4`). Every user mistake becomes one `ConfigError` that names the
field and the fix, never a traceback from deep inside pydantic.

- `base`: ConfigError and what every section shares (strict numbers, no inf/nan).
- `model`: model: and data:; `training`: optimizer:, schedule:, precision:;
  `run`: zero:, comm:, checkpoint:, logging:, train:.
- `tree`: `Config`, the whole tree, and the checks that span sections.
- `load`: files, overrides, library defaults, `build_config` / `load_config`.
"""

from zerotrain.config.base import ConfigError
from zerotrain.config.load import (
    LIBRARY_DEFAULTS,
    build_config,
    deep_merge,
    load_config,
    parse_overrides,
    read_config_file,
)
from zerotrain.config.model import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    llama_intermediate_size,
)
from zerotrain.config.run import (
    CheckpointConfig,
    CommConfig,
    FaultConfig,
    LoggingConfig,
    SpikeGuardConfig,
    TrainConfig,
    WandbConfig,
    ZeroConfig,
)
from zerotrain.config.sequence import SequenceConfig, check_sequence_parallel
from zerotrain.config.training import (
    FP8Config,
    LossScaleConfig,
    OptimizerConfig,
    OptimizerName,
    PrecisionConfig,
    ScheduleConfig,
)
from zerotrain.config.tree import Config, idle_settings

__all__ = [
    "LIBRARY_DEFAULTS", "CheckpointConfig", "CommConfig", "Config", "ConfigError",
    "DataConfig", "FP8Config", "FaultConfig", "LoggingConfig", "LossScaleConfig", "MoEConfig",
    "ModelConfig", "OptimizerConfig", "OptimizerName", "PrecisionConfig", "ScheduleConfig",
    "SequenceConfig",
    "SpikeGuardConfig", "TrainConfig", "WandbConfig", "ZeroConfig", "build_config",
    "check_sequence_parallel", "deep_merge", "idle_settings", "llama_intermediate_size",
    "load_config",
    "parse_overrides", "read_config_file",
]
