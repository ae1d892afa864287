"""A run's training steps, the same for both runtimes: the fill and the loop
(:func:`tba.runtime.loop.train_loop`) with the observers every run has (:mod:`tba.runtime.observers`);
the runtime brings the rollout source, the pace watch and, with ``eval.async``, the evaluation actor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from tba.config import BufferConfig, GenerationConfig, LoggingConfig, TrainerConfig
from tba.console import RunDisplay
from tba.metrics import MetricsLogger
from tba.runtime.fill import Fill
from tba.runtime.health import FallWatch, SlowdownWatch, remedy
from tba.runtime.loop import RolloutSource, StepClock, train_loop
from tba.runtime.observers import (
    BackgroundEvaluations,
    Checkpoints,
    Display,
    FinishedEvaluations,
    InlineEvaluation,
    MetricsLog,
    Watches,
)
from tba.runtime.pace import PaceMeter, run_layout
from tba.runtime.report import eval_key


class LoopSections(NamedTuple):
    """The config sections a run's steps read (the rest is the plan's)."""

    trainer: TrainerConfig
    buffer: BufferConfig
    generation: GenerationConfig
    logging: LoggingConfig
    eval_every: int  # ``eval.every``
    searchers: int = 1  # ``runtime.num_searchers`` resolved (the ray runtime's searchers)


def train_steps(
    c,
    sections: LoopSections,
    run_dir: Path,
    metrics: MetricsLogger,
    initial: dict,
    source: RolloutSource,
    slowdown: SlowdownWatch,
    say: Callable[[str], None],
    background: BackgroundEvaluations | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Fill the buffer and train ``c.trainer`` to ``trainer.steps``; ``initial``: the evaluation at
    step 0 (empty on a resume, or when the evaluation actor reports it later); ``say``: what the run
    must tell even when quiet; ``log``: its progress lines (the pace predicted from its first steps).
    Returns the loop's figures for ``summary.json``, its pace among them (:mod:`tba.runtime.pace`)."""
    t, b, g, plan = sections.trainer, sections.buffer, sections.generation, c.plan
    fill = None
    if not b.fresh_only:  # (fresh_only: each step's own groups, no buffer to fill)
        fill = Fill(
            c.buffer,
            t.batch_prompts,
            plan.min_groups,
            g.prompts_per_batch,
            b.fill_patience,
            say,
            b.min_completions,
        )
    key = eval_key(c)
    clock = StepClock(t.batch_prompts * g.group_size, c.trainer.device)
    watches = Watches(FallWatch.start(key, initial, run_dir, remedy(plan.objective, plan.trust_region)), slowdown, say)
    with RunDisplay.from_config(sections.logging, t.steps, key) as display:
        display.update(c.trainer.version, initial)
        if background is None:
            evaluation, finished = InlineEvaluation(c, run_dir, metrics, sections.eval_every, t.steps), None
        else:
            evaluation, finished = background, FinishedEvaluations(background, run_dir, metrics, watches)
        before = background.before_checkpoint if background is not None else None
        pace = PaceMeter(run_layout(t, g, plan, sections.searchers), clock, t.steps, c.trainer.version, log)
        pace.announce()
        observers = [
            pace,
            evaluation,
            watches,
            MetricsLog(metrics, sections.logging.every, key, clock),
            Checkpoints(c, run_dir, t.checkpoint_every, t.steps, before),
            *([finished] if finished is not None else []),
            Display(display, source, finished),
        ]
        return {**train_loop(c.trainer, source, fill, observers, t.steps, clock), **pace.summary()}
