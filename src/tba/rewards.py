"""Reward evaluation that survives bad samples.

A reward function that raises, or returns something that is not a finite number, must not end a
long run: the sample is dropped and counted, and the caller reports the count as a metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RewardStats:
    errors: int = 0  # the reward function raised
    non_finite: int = 0  # it returned NaN, inf or a non-number
    last_error: str | None = None
    examples: list[str] = field(default_factory=list)  # first few error messages, for the log

    def as_metrics(self, prefix: str = "searcher/") -> dict[str, float]:
        return {f"{prefix}reward_errors": float(self.errors), f"{prefix}reward_non_finite": float(self.non_finite)}


def safe_reward(fn: Callable[[], float], stats: RewardStats) -> float | None:
    """Call ``fn()``; on an exception or a non-finite value return None and count it."""
    try:
        value = fn()
    except Exception as exc:  # a user's reward function can fail in any way; count, keep going
        stats.errors += 1
        stats.last_error = f"{type(exc).__name__}: {exc}"
        if len(stats.examples) < 5:
            stats.examples.append(stats.last_error)
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        stats.non_finite += 1
        return None
    if not math.isfinite(value):
        stats.non_finite += 1
        return None
    return value
