"""Run configuration: a pydantic schema, YAML files and dotted command line overrides.

Every field has a docstring; the defaults run the built-in demo (a tiny model learning integer
arithmetic on a CPU). ``load_config(path, ["--trainer.lr=3e-4", ...])`` merges a YAML file and
overrides into the defaults and validates the result; a bad key or value raises
:class:`ConfigError` naming the offending path (``trainer.lr``).

The package, one idea a module: the sections (:mod:`~tba.config.run`, :mod:`~tba.config.task`,
:mod:`~tba.config.generation`, :mod:`~tba.config.training`, :mod:`~tba.config.runtime`), the
whole (:mod:`~tba.config.schema`) and the rules across sections (:mod:`~tba.config.rules`),
overrides (:mod:`~tba.config.overrides`), errors (:mod:`~tba.config.errors`) and files
(:mod:`~tba.config.files`). It imports nothing heavy (no torch), so the CLI can reject a bad
config instantly.
"""

from tba.config.errors import ConfigError
from tba.config.files import absolute_paths, build_config, dump_config, load_config, with_values
from tba.config.generation import GenerationConfig, VLLMSettings
from tba.config.overrides import parse_overrides
from tba.config.run import LoraConfig, ModelConfig, RunConfig
from tba.config.runtime import EvalConfig, LoggingConfig, RuntimeConfig
from tba.config.schema import Config
from tba.config.task import (
    TASK_NAMES,
    TLDR_DATASET,
    ArithmeticTaskConfig,
    DatasetTaskConfig,
    GSM8KTaskConfig,
    ReasoningGymTaskConfig,
    RedteamTaskConfig,
    TaskConfig,
    TLDRTaskConfig,
    VerifiersTaskConfig,
)
from tba.config.training import BufferConfig, ObjectiveConfig, TrainerConfig

__all__ = [
    "TASK_NAMES",
    "TLDR_DATASET",
    "ArithmeticTaskConfig",
    "BufferConfig",
    "Config",
    "ConfigError",
    "DatasetTaskConfig",
    "EvalConfig",
    "GSM8KTaskConfig",
    "GenerationConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "ReasoningGymTaskConfig",
    "VerifiersTaskConfig",
    "RedteamTaskConfig",
    "RunConfig",
    "RuntimeConfig",
    "TLDRTaskConfig",
    "TaskConfig",
    "TrainerConfig",
    "VLLMSettings",
    "absolute_paths",
    "build_config",
    "dump_config",
    "load_config",
    "parse_overrides",
    "with_values",
]
