"""The task interface: prompts, reference answers, a reward, and an evaluation metric.

A task knows nothing about models or tokenizers: it deals in text. Searchers ask it for training
prompts and rewards; the evaluator asks it for the held-out split and a score per completion.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str  # stable across runs: the replay buffer groups completions by it
    text: str
    answer: str | None = None  # reference answer, where the task has one


class Task(ABC):
    name: str = "task"
    eval_metric: str = "accuracy"

    @abstractmethod
    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` training prompts (never from the evaluation split)."""

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The held-out evaluation split, in a fixed order."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Reward of one completion (decoded text, special tokens removed)."""

    def score(self, prompt: Prompt, completion: str) -> float:
        """Evaluation score of one greedy completion; by default the reward."""
        return self.reward(prompt, completion)
