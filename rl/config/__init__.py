"""The run's configuration, Flyte-free: `GRPOConfig` and its sections, checked on construction.

- `rl.config.sections`: the section dataclasses and `GRPOConfig`, each field documented by the string under it;
- `rl.config.loading`: a config from a mapping (`config_from_dict`), inline JSON or a YAML/JSON file (`load_config`);
- `rl.config.parsing`: the strict JSON and YAML readers and the builder they share, without I/O;
- `rl.config.checks`: field types, the error style (``config {where}: {problem}; {fix}``), section names, the rules
  across sections;
- `rl.config.descriptions`: field docstrings as the descriptions of flytekit's JSON schema and docs/config.md.

The cluster's ``resources`` section belongs to the layer that places tasks: ``tasks.run_config.RunConfig`` is a
`GRPOConfig` with it, and the ``root`` argument of the loaders builds one.
"""

from rl.config.loading import config_from_dict, config_from_json, env_storage_options, load_config
from rl.config.sections import (
    ADV_ESTIMATORS,
    DEFAULT_MODEL,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_GRADIENTS,
    KL_TYPES,
    LORA_ALL_LINEAR,
    LOSS_TYPES,
    CheckpointingConfig,
    DataConfig,
    DataPlaneConfig,
    EnvConfig,
    GenerationConfig,
    GRPOConfig,
    GRPOSettings,
    LoRASettings,
    LossConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    PolicyConfig,
    RewardShapingConfig,
    TrackingConfig,
    VLLMConfig,
)

__all__ = [
    "ADV_ESTIMATORS",
    "DEFAULT_MODEL",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_GRADIENTS",
    "KL_TYPES",
    "LORA_ALL_LINEAR",
    "LOSS_TYPES",
    "CheckpointingConfig",
    "DataConfig",
    "EnvConfig",
    "DataPlaneConfig",
    "GRPOConfig",
    "GRPOSettings",
    "GenerationConfig",
    "LoRASettings",
    "LossConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyConfig",
    "RewardShapingConfig",
    "TrackingConfig",
    "VLLMConfig",
    "config_from_dict",
    "config_from_json",
    "env_storage_options",
    "load_config",
]
