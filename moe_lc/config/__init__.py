"""Recipes: sections (`sections.py`), choices (`choices.py`), rules (`rules.py`), loading and printing
(`loading.py`). Import from here."""

from moe_lc.config.loading import (MOVED_MODEL_KEYS, apply_overrides, build_config, load_config, model_config,
                                   read_recipe, to_toml)
from moe_lc.config.rules import (ConfigError, choice_errors, cross_section_errors, layout_errors, pipeline_stages,
                                 resolve_degrees, schedule_shape_errors, tensor_parallel_errors, validate)
from moe_lc.config.sections import (SECTIONS, CheckpointConfig, Config, DataConfig, DSAConfig, MLAConfig, ModelConfig,
                                    MoEConfig,
                                    MTPConfig, ParallelConfig, PrecisionConfig, RecomputeConfig, RopeConfig, TrainConfig)

__all__ = [
    "MOVED_MODEL_KEYS", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DSAConfig", "MLAConfig",
    "MTPConfig",
    "ModelConfig", "MoEConfig", "ParallelConfig", "PrecisionConfig", "RecomputeConfig", "RopeConfig", "TrainConfig",
    "apply_overrides", "build_config", "choice_errors", "cross_section_errors", "layout_errors", "load_config",
    "model_config",
    "pipeline_stages", "read_recipe", "resolve_degrees", "schedule_shape_errors", "tensor_parallel_errors", "to_toml", "validate",
]
