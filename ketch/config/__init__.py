"""Typed configuration: schema, loading with overrides, validation and derived batch sizes."""

from ketch.config.batch import BatchError, BatchPlan, UpdatePlan, derive_batch_plan
from ketch.config.errors import ConfigError
from ketch.config.loader import load_config, parse_overrides, to_dict, to_yaml
from ketch.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KetchConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "BatchError",
    "BatchPlan",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "KetchConfig",
    "ModelConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "UpdatePlan",
    "derive_batch_plan",
    "load_config",
    "parse_overrides",
    "to_dict",
    "to_yaml",
]
