"""The task interface: prompts, batched rewards, and what evaluation scores.

A task speaks text. Searchers ask it for training prompts and for the rewards of a batch of
completions; the evaluation code asks it for the held-out split and a score per completion. A
task that needs models of its own (a reward model, a victim, a classifier) loads them in
:meth:`Task.setup`, which runs in searcher and evaluation processes only, never in the trainer.

Rewards follow TRL's convention: a task exposes reward functions called on batches as
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, where ``prompts``
and ``completions`` are strings, or chat message lists when the prompt was a message list, and
every extra column of a prompt arrives by name as a list. ``tba.rewards.compute_rewards`` calls
them, combines them by weight, and counts and skips the samples they fail on.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tba.rewards import RewardFn, RewardStats, check_reward_functions, compute_rewards
from tba.types import EvalResult, EvalSettings

DUMMY_COMPLETIONS = ["The answer is 42.", "I am not sure."]  # for the dry run of reward functions


@dataclass(frozen=True)
class Prompt:
    id: str  # stable across runs and processes: the replay buffer groups completions by it
    text: str  # the prompt text; for a message list, its last user turn (for display)
    answer: str | None = None  # reference answer, where the task has one
    messages: tuple[Mapping[str, Any], ...] | None = None  # a chat prompt: [{role, content}, ...]
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)  # reach reward functions

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def as_reward_input(self) -> str | list[dict]:
        return [dict(m) for m in self.messages] if self.messages is not None else self.text


@dataclass
class EvalContext:
    """What a task's own evaluation may use: the policy's generator (``tba.generation``), the
    tokenizer, the settings, and the frozen reference model where the runtime has one."""

    generator: Any
    tokenizer: Any
    settings: EvalSettings
    chat_template: bool | None
    eos_ids: set[int]
    reference: Any = None


class Task(ABC):
    name: str = "task"
    eval_metric: str = "accuracy"  # evaluation logs eval/<eval_metric>: the mean score
    success_scores: bool = True  # scores are successes (> 0.5): pass@k and maj@k apply

    def setup(self, device=None) -> None:
        """Load what the task owns (reward models, classifiers); called in searcher and evaluation
        processes before the first reward, never in the trainer. Nothing to load by default."""
        return None

    @abstractmethod
    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` training prompts (never from the evaluation split)."""

    def sampler_state(self) -> dict:
        """What :meth:`sample_prompts` keeps between calls besides the caller's ``rng`` (plain data,
        saved in checkpoints so a resumed run draws the same prompts); nothing by default."""
        return {}

    def load_sampler_state(self, state: dict) -> None:
        """Restore a :meth:`sampler_state`."""
        return None

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The held-out evaluation split, in a fixed order."""

    @abstractmethod
    def reward_functions(self) -> list[RewardFn]:
        """The batched reward functions whose weighted sum is the reward."""

    def rewards(
        self, prompts: list[Prompt], completions: list[str], completion_ids: list[list[int]], stats: RewardStats
    ) -> list[float | None]:
        """One reward per completion (``prompts[i]`` produced ``completions[i]``); None for a sample
        that no function scored or that a function failed on (counted in ``stats``)."""
        args, comps, columns = reward_inputs(prompts, completions)
        return compute_rewards(self.reward_functions(), args, comps, completion_ids, columns, stats)

    def scores(
        self, prompts: list[Prompt], completions: list[str], completion_ids: list[list[int]], stats: RewardStats
    ) -> list[float | None]:
        """Evaluation score of each completion; by default its reward."""
        return self.rewards(prompts, completions, completion_ids, stats)

    def evaluate(self, ctx: EvalContext) -> EvalResult | None:
        """A task-specific evaluation; None (the default) runs the generic one: greedy scores,
        and pass@k / maj@k with ``eval.samples``."""
        return None

    def is_success(self, score: float) -> bool:
        return score > 0.5

    def eval_group(self, prompt: Prompt) -> str | None:
        """The part of the evaluation split a prompt belongs to (a dataset of a mix): evaluation logs
        each part's mean score as ``eval/<eval_metric>/<group>`` beside the whole's. None: no parts."""
        return None

    def answer_key(self, completion: str) -> str | None:
        """The answer a completion gives, for majority voting (maj@k); by default the whole text."""
        return completion.strip() or None

    def check(self) -> None:
        """Fail fast, before any model is loaded, if the reward functions cannot score two
        evaluation rows (raises ``tba.rewards.RewardFunctionError`` naming the function)."""
        fns = self.checkable_reward_functions()
        if not fns:
            return
        rows = self.eval_prompts()[:2]
        comps = DUMMY_COMPLETIONS[: len(rows)]
        args, comps, columns = reward_inputs(rows, comps)
        check_reward_functions(fns, args, comps, [[] for _ in rows], columns)

    def checkable_reward_functions(self) -> list[RewardFn]:
        """The reward functions that can be dry-run before any model is loaded."""
        return self.reward_functions()

    def describe(self) -> str:
        """One line for the run log: what the task holds."""
        return f"task {self.name}: {len(self.eval_prompts())} evaluation prompts"


def reward_inputs(prompts: list[Prompt], completions: list[str]) -> tuple[list, list, dict[str, list]]:
    """TRL's arguments: prompts and completions as text or messages, and the columns as lists."""
    args = [p.as_reward_input() for p in prompts]
    comps: list = [
        [{"role": "assistant", "content": c}] if p.is_chat else c for p, c in zip(prompts, completions, strict=True)
    ]
    names: dict[str, None] = {}
    for p in prompts:
        names.update(dict.fromkeys(p.columns))
    columns = {name: [p.columns.get(name) for p in prompts] for name in names}
    return args, comps, columns
