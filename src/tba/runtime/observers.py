"""What watches a training step (:func:`tba.runtime.loop.train_loop`), in the order the loop calls
them: evaluation (inline, or submitted to the evaluation actor), the run's watches (a fall below the
start, a slowdown), the metrics log, checkpoints, the background evaluations that finished, the
display. Each is an ``after_step(step, record)``; an evaluation's metrics join the step's record
before it is logged, so a checkpoint always finds its step logged. They hold nothing to release:
the runtime that made the metrics logger and the evaluation actor closes them, after a failure
too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tba.console import RunDisplay
from tba.evaluation import write_samples
from tba.metrics import MetricsLogger
from tba.runtime.health import FallWatch, SlowdownWatch
from tba.runtime.loop import RolloutSource, StepClock
from tba.runtime.report import evaluate_policy
from tba.runtime.run_dir import save


def due(step: int, every: int | None, last: int) -> bool:
    """Whether something done every ``every`` steps (and at the last) is due at ``step``."""
    return bool(every and step % every == 0) or step == last


class InlineEvaluation:
    """Evaluate the trainer's policy in this process when due; the metrics join the step's record."""

    def __init__(self, c, run_dir: Path, metrics: MetricsLogger, every: int | None, last: int) -> None:
        self.c, self.run_dir, self.metrics, self.every, self.last = c, run_dir, metrics, every, last

    def after_step(self, step: int, record: dict) -> None:
        if due(step, self.every, self.last):
            record.update(evaluate_policy(self.c, self.run_dir, step, self.metrics))


class BackgroundEvaluations:
    """``eval.async``: the trainer's weights go to the evaluation actor when due; what it finished
    is collected here and logged by :class:`FinishedEvaluations` at the step it evaluated."""

    def __init__(self, background, weights: Callable[[], object], every: int, last: int) -> None:
        """``weights``: the trainer's current weights for the actor (the published copy when there is one)."""
        self.background, self.weights, self.every, self.last = background, weights, every, last
        self.finished: list = []

    def after_step(self, step: int, record: dict) -> None:
        self.finished += self.background.poll()
        if due(step, self.every, self.last):
            self.finished += self.background.submit(step, self.weights())
            record["trainer/eval_wait_s"] = self.background.waited_s

    def before_checkpoint(self) -> None:
        """Its results belong before the checkpoint, like a step's own."""
        self.finished += self.background.finish()

    def take(self) -> list:
        finished, self.finished = self.finished, []
        return finished


class Watches:
    """A fall below the start (:class:`FallWatch`) and steps slowed by other processes
    (:class:`SlowdownWatch`, on a step and its wait for data); what they say goes through ``say``
    (on the console even when quiet, and in ``errors.log``)."""

    def __init__(self, fall: FallWatch, slowdown: SlowdownWatch, say: Callable[[str], None]) -> None:
        self.fall, self.slowdown, self.say = fall, slowdown, say

    def after_step(self, step: int, record: dict) -> None:
        parts = ("trainer/wait_s", "searcher/generate_s", "train/step_s")  # a step and what it waited for
        pace = sum(record.get(key, 0.0) for key in parts)
        for message in (self.fall.observe(step, record), self.slowdown.observe(pace)):
            if message:
                self.say(message)


class MetricsLog:
    """The step's record into ``metrics.jsonl`` (and TensorBoard, W&B) every ``logging.every`` steps
    and at every evaluation, with the trainer's peak memory since the previous log."""

    def __init__(self, metrics: MetricsLogger, every: int, key: str, clock: StepClock) -> None:
        self.metrics, self.every, self.key, self.clock = metrics, every, key, clock

    def after_step(self, step: int, record: dict) -> None:
        if step % self.every == 0 or self.key in record:
            record["train/peak_memory_gb"] = self.clock.take_peak()
            self.metrics.log(step, record)


class Checkpoints:
    """A checkpoint every ``trainer.checkpoint_every`` steps and at the last (with the prompt
    ledger), after the step is logged."""

    def __init__(self, c, run_dir: Path, every: int | None, last: int, before: Callable[[], None] | None = None):
        self.c, self.run_dir, self.every, self.last, self.before = c, run_dir, every, last, before

    def after_step(self, step: int, record: dict) -> None:
        if due(step, self.every, self.last):
            if self.before is not None:
                self.before()
            save(self.c, self.run_dir)


class FinishedEvaluations:
    """The evaluation actor's results, each logged at the step whose weights it evaluated (after
    the steps that followed it), seen by the fall watch, and shown."""

    def __init__(self, evaluations: BackgroundEvaluations, run_dir: Path, metrics: MetricsLogger, watches: Watches):
        self.evaluations, self.run_dir, self.metrics, self.watches = evaluations, run_dir, metrics, watches
        self.shown: list = []

    def after_step(self, step: int, record: dict) -> None:
        self.shown = []
        for f in self.evaluations.take():
            write_samples(self.run_dir, f.step, f.samples, f.answers)
            self.metrics.log_samples(f.step, f.samples)
            if message := self.watches.fall.observe(f.step, f.metrics):
                self.watches.say(message)
            self.metrics.log(f.step, f.metrics)
            self.shown.append(f.metrics)


class Display:
    """The progress line; the searchers' versions where the source has them. The display stays at
    the trainer's step when a background evaluation of an earlier one comes in."""

    def __init__(self, display: RunDisplay, source: RolloutSource, finished: FinishedEvaluations | None = None):
        self.display, self.source, self.finished = display, source, finished

    def after_step(self, step: int, record: dict) -> None:
        for metrics in self.finished.shown if self.finished is not None else ():
            self.display.update(step, metrics)
        versions = self.source.versions()
        if versions is None:
            self.display.update(step, record)
        else:
            self.display.update(step, record, versions)
