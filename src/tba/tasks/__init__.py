"""Tasks: where prompts come from, what rewards completions, what evaluation measures.

Each task type is one module here and one config class in ``tba.config`` (``task.name`` picks
both). ``build_task(cfg.task, tokenizer=...)`` returns the task; the tokenizer is needed only to
drop prompts longer than ``task.max_prompt_tokens``.
"""

from __future__ import annotations

from tba.tasks.arithmetic import ArithmeticTask
from tba.tasks.base import Prompt, Task

__all__ = ["ArithmeticTask", "Prompt", "Task", "build_task", "TASKS"]


def _arithmetic(cfg, **_) -> Task:
    return ArithmeticTask(cfg.digits, cfg.operators, cfg.eval_size, cfg.seed, cfg.terms, cfg.show_work)


def _dataset(cfg, **kwargs) -> Task:
    from tba.tasks.dataset import DatasetTask  # imports datasets: only when asked for

    return DatasetTask(cfg, **kwargs)


def _gsm8k(cfg, **kwargs) -> Task:
    from tba.tasks.gsm8k import GSM8KTask

    return GSM8KTask(cfg, **kwargs)


def _tldr(cfg, **kwargs) -> Task:
    from tba.tasks.tldr import TLDRTask

    return TLDRTask(cfg, **kwargs)


def _redteam(cfg, **kwargs) -> Task:
    from tba.tasks.redteam import RedteamTask

    return RedteamTask(cfg, **kwargs)


def _verifiers(cfg, **kwargs) -> Task:
    from tba.tasks.verifiers import VerifiersTask  # imports verifiers: only when asked for

    return VerifiersTask(cfg, **kwargs)


def _reasoning_gym(cfg, **kwargs) -> Task:
    from tba.tasks.reasoning_gym import ReasoningGymTask  # imports reasoning_gym: only when asked for

    return ReasoningGymTask(cfg, **kwargs)


TASKS = {
    "arithmetic": _arithmetic,
    "dataset": _dataset,
    "gsm8k": _gsm8k,
    "tldr": _tldr,
    "redteam": _redteam,
    "reasoning_gym": _reasoning_gym,
    "verifiers": _verifiers,
}


def build_task(cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None) -> Task:
    """The task named by ``cfg.name`` (a ``config.*TaskConfig``)."""
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task {cfg.name!r}; built in: {', '.join(TASKS)}")
    return TASKS[cfg.name](cfg, tokenizer=tokenizer, chat_template=chat_template, log=log, base_dir=base_dir)
