"""Tasks: where prompts, answers and rewards come from."""

from __future__ import annotations

from tba.tasks.arithmetic import ArithmeticTask
from tba.tasks.base import Prompt, Task

__all__ = ["ArithmeticTask", "Prompt", "Task", "build_task"]


def build_task(cfg) -> Task:
    """The task named by ``cfg.name`` (a ``config.*TaskConfig``)."""
    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.digits, cfg.operators, cfg.eval_size, cfg.seed)
    raise ValueError(f"unknown task {cfg.name!r}; built in: arithmetic")
