"""The training loop of both runtimes, joined to three narrow parts:

    fill the buffer (watched: a fill that delivers nothing trainable stops the run)
    loop until the last step:
        batch ← source.next(version)         the bounds: the source waits for data
        record ← trainer.learn(batch)         sample → objective → optimizer
        every k steps publish the weights     the searchers load them between batches
        every observer sees (step, record)   evaluation, watches, metrics, checkpoints, display

- a :class:`RolloutSource` hands over scored groups: the sync runtime's searcher in this process,
  which generates when asked (:class:`tba.runtime.sources.LocalSource`), or the ray runtime's inbox
  of searcher actors, under the replay and staleness bounds
  (:class:`tba.runtime.sources.InboxSource`);
- the trainer (:class:`tba.trainer.Trainer`, its updates local or on ranks) takes the step;
- everything else observes a step (:class:`Observer`): :mod:`tba.runtime.observers`.

One :class:`StepClock` times the loop for both runtimes: the wait for data under the bounds (the ray
runtime), the step, and the observers' pauses, which it leaves out of the trainer's busy fraction
and throughput (the sync runtime's generation counts as time the trainer is not busy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tba.models.precision import PeakMemory
from tba.runtime.fill import Fill
from tba.trainer import Trainer
from tba.types import Batch


@dataclass
class Delivery:
    """What a source hands over for one step."""

    batch: Batch | None = None  # a batch to train on as it is; None: the trainer samples its buffer
    empty: bool = False  # nothing to train on this step (every group of a fresh batch dropped)
    wait_s: float = 0.0  # what the trainer waited for it under the bounds (the ray runtime)
    generate_s: float = 0.0  # what generating it took the loop (the sync runtime: in turn with training)
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutSource(Protocol):
    def fill(self, fill: Fill) -> None:
        """Deliver into the trainer's buffer until ``fill.ready()``, reporting each delivery to it."""

    def next(self, version: int) -> Delivery:
        """The data of the step from ``version``, once the bounds allow it."""

    def stepped(self) -> None:
        """The step was taken."""

    def metrics(self) -> dict[str, float]:
        """The searchers' and the prompt ledger's figures for the step's record."""

    def versions(self) -> list[int | None] | None:
        """The weight version each searcher holds (None: restarting), for the display; None: not shown."""

    def summary(self) -> dict:
        """What the run's ``summary.json`` gets from the source."""


class Observer(Protocol):
    def after_step(self, step: int, record: dict) -> None:
        """See the step's ``record`` (logged at ``step``); may add to it."""


class StepClock:
    """Where the loop's time goes: the wait for data, the steps, the pauses of the observers
    (evaluation, checkpoints: not counted as the trainer's), and the trainer's peak memory over its
    steps since the last :meth:`take_peak`."""

    def __init__(self, samples_per_step: int, device) -> None:
        self.samples_per_step = samples_per_step
        self.peak = PeakMemory(device)
        self.step_peak = 0.0
        self.start = self.begun = self.trained = self.observed = time.perf_counter()
        self.cpu_start = self.observed_cpu = time.process_time()
        self.busy_s = self.paused_s = self.paused_cpu_s = self.wait_total_s = self.longest_pause_s = 0.0
        self.samples = 0

    def restart(self) -> None:
        """The loop starts now: its active time counts from here."""
        self.start = self.observed = time.perf_counter()
        self.cpu_start = self.observed_cpu = time.process_time()

    def begin(self) -> None:
        self.begun = time.perf_counter()

    def training(self, delivery: Delivery) -> None:
        """The data is here; the step starts. The pause since the last step is what neither the
        wait for data nor its generation took (draining the inbox, the source's bookkeeping)."""
        self.trained = time.perf_counter()
        self.wait_s = delivery.wait_s
        self.wait_total_s += delivery.wait_s
        pause = self.trained - self.begun - delivery.wait_s - delivery.generate_s
        self.longest_pause_s = max(self.longest_pause_s, pause)
        self.peak.reset()  # the step's own: generation (an engine's memory) is not the trainer's

    def stepped(self) -> None:
        self.busy_s += time.perf_counter() - self.trained
        self.samples += self.samples_per_step
        self.step_peak = max(self.step_peak, self.peak.read())
        self.observed = time.perf_counter()
        self.observed_cpu = time.process_time()

    def paused(self) -> None:
        """The observers are done: their time is not the loop's."""
        self.paused_s += time.perf_counter() - self.observed
        self.paused_cpu_s += time.process_time() - self.observed_cpu

    def active_s(self) -> float:
        return max(time.perf_counter() - self.start - self.paused_s, 1e-9)

    def active_cpu_s(self) -> float:
        """The process's CPU seconds (every thread's) in the loop's active time."""
        return time.process_time() - self.cpu_start - self.paused_cpu_s

    def metrics(self) -> dict[str, float]:
        active = self.active_s()
        return {
            "trainer/wait_s": self.wait_s,
            "trainer/wait_total_s": self.wait_total_s,
            "trainer/busy_fraction": self.busy_s / active,
            "trainer/samples_per_s": self.samples / active,
            "trainer/longest_pause_s": self.longest_pause_s,
        }

    def take_peak(self) -> float:
        """The highest peak of the steps since the last call, in GiB."""
        peak, self.step_peak = self.step_peak, 0.0
        return peak

    def summary(self) -> dict:
        return {
            "trainer_busy_fraction": round(self.busy_s / self.active_s(), 4),
            "trainer_longest_pause_s": round(self.longest_pause_s, 3),
            "trainer_wait_s": round(self.wait_total_s, 3),
        }


def train_loop(
    trainer: Trainer, source: RolloutSource, fill: Fill | None, observers: list[Observer], steps: int, clock: StepClock
) -> dict:
    """Train until ``steps``: the fill (None: none, ``buffer.fresh_only``), then a step at a time,
    each seen by every observer in order. Returns the run's figures for ``summary.json``."""
    if fill is not None:
        source.fill(fill)
    clock.restart()  # (the fill is not the loop's time)
    while trainer.version < steps:
        clock.begin()
        delivery = source.next(trainer.version)
        clock.training(delivery)
        record = trainer.learn_nothing() if delivery.empty else trainer.learn(delivery.batch)
        record = trainer.publish_due(record)  # the weights to the searchers, every trainer.sync_interval
        source.stepped()
        clock.stepped()
        record.update(delivery.metrics)
        record.update(source.metrics())
        record.update(clock.metrics())
        for observer in observers:
            observer.after_step(trainer.version, record)
        clock.paused()
    return {**clock.summary(), **source.summary()}
