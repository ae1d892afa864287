"""Exploration across searchers: sampling settings that differ per searcher, and per batch.

The TBA paper's code can make some batches explore: with probability ``prob`` a generation batch
samples at a temperature drawn from ``U(t_lo, t_hi)`` and a top-p drawn from ``U(p_lo, p_hi)``
(the authors: probability 0.3, ``U(T, T·1.1/0.7)`` and ``U(0.7, 1)``). Trajectory balance is valid
for data from any sampler, so more searchers can mean more diverse data, not only more of it.
:class:`ExploringGenerator` wraps any generator and does that draw before each sampled batch;
greedy calls (evaluation) pass through untouched.
"""

from __future__ import annotations

import random
from dataclasses import replace

from tba.generation.base import Completion, Generator, SamplingParams


class ExploringGenerator:
    def __init__(
        self,
        inner: Generator,
        prob: float,
        temperature: tuple[float, float],
        top_p: tuple[float, float],
        seed: int = 0,
    ):
        self.inner = inner
        self.prob = prob
        self.temperature = temperature
        self.top_p = top_p
        self.rng = random.Random(seed)
        self.last: SamplingParams | None = None  # what the latest batch used
        self.explored = 0  # batches that explored

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if not params.greedy and self.rng.random() < self.prob:
            params = replace(
                params, temperature=self.rng.uniform(*self.temperature), top_p=self.rng.uniform(*self.top_p)
            )
            self.explored += 1
        self.last = params
        return self.inner.generate(prompts, params)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.inner.load_weights(state_dict, version)

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # model, batch_size, ... of the wrapped backend
