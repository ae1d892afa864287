"""Schedules as plain functions of the trainer step: β annealing and learning-rate multipliers."""

from __future__ import annotations

import math


def beta_at(
    step: int, beta: float, beta_final: float | None = None, anneal_steps: int = 0, final_from: int | None = None
) -> float:
    """β at ``step``: constant, or linear from ``beta`` to ``beta_final`` over ``anneal_steps``,
    and ``beta_final`` from step ``final_from`` on if that comes first.

    The paper's GSM8K setting is ``beta_at(step, 0.014, 0.004, 500)``; its TL;DR setting moves
    from 1.0 towards 0.05 and jumps there at step 32: ``beta_at(step, 1.0, 0.05, 256, 32)``.
    """
    if beta_final is not None and final_from is not None and step >= final_from:
        return beta_final
    if beta_final is None or anneal_steps <= 0:
        return beta
    frac = min(max(step, 0) / anneal_steps, 1.0)
    return beta + (beta_final - beta) * frac


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_ratio: float = 0.0,
    stable_steps: int = 0,
    decay_steps: int | None = None,
) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Linear warmup from 1/(warmup+1) to 1 over ``warmup_steps`` (so step 0 is not wasted at lr 0),
    ``stable_steps`` at the peak, then constant, or cosine / linear decay to ``min_ratio`` over
    ``decay_steps`` (default: until the last step; a longer span is cut where training ends, as in
    the paper's GSM8K schedule: 50 warmup, 350 stable, cosine over 600, cut at 700).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    start = warmup_steps + stable_steps
    if schedule == "constant" or step < start:
        return 1.0
    span = max(decay_steps if decay_steps is not None else total_steps - 1 - start, 1)
    frac = min((step - start) / span, 1.0)
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * frac))
    elif schedule == "linear":
        decay = 1.0 - frac
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant, cosine or linear")
    return min_ratio + (1.0 - min_ratio) * decay
