"""The whole configuration: one field per section, and the rules that span sections (:mod:`tba.config.rules`)."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from tba.config.generation import GenerationConfig
from tba.config.rules import check_batches, check_runtime
from tba.config.run import ModelConfig, RunConfig
from tba.config.runtime import EvalConfig, LoggingConfig, RuntimeConfig
from tba.config.section import Section
from tba.config.task import ArithmeticTaskConfig, TaskConfig
from tba.config.training import BufferConfig, ObjectiveConfig, TrainerConfig


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = ArithmeticTaskConfig()
    generation: GenerationConfig = GenerationConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_task_name(cls, data: Any) -> Any:
        # A task section without a name keeps the default task, so `--task.digits=1` still works.
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "name" not in data["task"]:
            data = {**data, "task": {"name": "arithmetic", **data["task"]}}
        return data

    @model_validator(mode="after")
    def _check_batches(self) -> Config:
        """Batch and buffer sizes that fit together."""
        check_batches(self)
        return self

    @model_validator(mode="after")
    def _check_runtime(self) -> Config:
        """Settings that only one runtime supports, and settings that exclude each other."""
        check_runtime(self)
        return self
