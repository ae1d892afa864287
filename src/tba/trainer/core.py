"""The trainer role: replay buffer in, optimizer steps out, weights published every k steps.

A :class:`Trainer` is a :class:`~tba.trainer.learner.Learner` (the policy, its optimizer and the
objective) joined to the run's replay buffer and the sender of its weights. One call of
:meth:`Trainer.step`, a hand-written loop's step:

    sample a batch of groups from the buffer → the learner's optimizer step
    → every k steps publish weights (and open a new "recent data" window in the buffer)

The runtimes' loop (:func:`tba.runtime.loop.train_loop`) calls :meth:`Trainer.learn` and
:meth:`Trainer.publish_due` itself, so that the publication is a line of the loop.

The buffer's recent window starts when a publication becomes visible to searchers
(:meth:`Trainer._mark_visible`), asked before each arrival, each draw and after each publication.
"""

from __future__ import annotations

import time

import torch

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.trainer.learner import Learner
from tba.types import Batch, RolloutGroup
from tba.weights import Sender


class Trainer(Learner):
    def __init__(
        self,
        model: torch.nn.Module,
        buffer: ReplayBuffer,
        weights: Sender,
        cfg: TrainerConfig,
        objective: ObjectiveConfig,
        group_size: int,
        pad_id: int,
        eos_ids: set[int],
        max_new_tokens: int | None = None,
        **learner,
    ):
        """The learner's arguments (:class:`~tba.trainer.learner.Learner`), with the run's ``buffer``
        and the ``weights`` sender its publications go through."""
        super().__init__(model, cfg, objective, group_size, pad_id, eos_ids, max_new_tokens, **learner)
        self.buffer = buffer
        self.weights = weights
        self.before_write = weights.settle  # a publication that reads the weights finishes first
        self._arrival_lag_max = 0
        self._marked_version = -1  # the newest version searchers could fetch when the buffer last marked it

    def ingest(self, groups: list[RolloutGroup]) -> int:
        """Put arrived groups in the buffer; returns the number of new rollouts."""
        self._mark_visible()
        for g in groups:  # how stale data is when it arrives: k - 1 plus the searcher's batch time
            self._arrival_lag_max = max(self._arrival_lag_max, self.version - g.policy_version)
        return sum(self.buffer.add(g, step=self.version) for g in groups)

    def publish(self) -> float:
        """Publish the current weights as version ``self.version`` (a LoRA policy's adapter only);
        returns the seconds it took the trainer. With a :class:`~tba.weights.BackgroundPublisher`
        that is the hand-over: the weights travel while the trainer goes on, and the buffer's recent
        window starts when searchers can fetch them (:meth:`_mark_visible`)."""
        start = time.perf_counter()
        self.updates.publish(self.weights, self.version, self.publish_dtype)
        self._mark_visible()
        return time.perf_counter() - start

    def republish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Publish ``state`` as ``version`` again (a resumed run: what its searcher loads next),
        without opening a recent window in the buffer: the restored buffer has the windows it had."""
        self.weights.publish(state, version)
        self.weights.flush()
        self._marked_version = max(self._marked_version, self.weights.visible_version)

    def flush_publication(self) -> None:
        """Wait until the weights handed over are where searchers fetch them (before searchers
        start: they need a first version)."""
        self.weights.flush()
        self._mark_visible()

    def _mark_visible(self) -> None:
        """Start the buffer's recent window once a newer publication is visible to searchers."""
        if self.weights.visible_version > self._marked_version:
            self._marked_version = self.weights.visible_version
            self.buffer.mark_sync()

    def step(self, batch: Batch | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (by default one sampled from the replay buffer), then the
        publication when due (:meth:`publish_due`): a hand-written loop's step."""
        return self.publish_due(self.learn(batch))

    def skip(self) -> dict[str, float]:
        """:meth:`learn_nothing`, then the publication when due."""
        return self.publish_due(self.learn_nothing())

    def learn(self, batch: Batch | None = None, started: float | None = None) -> dict[str, float]:
        """The learner's step on ``batch``, by default one sampled from the replay buffer, with the
        buffer's figures. Publishes nothing."""
        start = time.perf_counter() if started is None else started
        self._mark_visible()
        if batch is None:
            batch = self.buffer.sample(self.cfg.batch_prompts, self.group_size)
        metrics = super().learn(batch, start)
        metrics["buffer/arrival_lag_max"] = float(self._arrival_lag_max)
        metrics.update(self.buffer.stats())
        self._arrival_lag_max = 0
        return self._waited(metrics)

    def learn_nothing(self) -> dict[str, float]:
        return self._waited(super().learn_nothing())

    def _waited(self, metrics: dict[str, float]) -> dict[str, float]:
        """What waiting for a publication before the optimizer cost the trainer's path."""
        if self.write_wait_s:
            metrics["train/publish_s"] = self.write_wait_s
            self.write_wait_s = 0.0
        return metrics

    def publish_due(self, metrics: dict[str, float]) -> dict[str, float]:
        """Publish the current weights if the version is one to publish, every
        ``trainer.sync_interval`` steps (its seconds join ``train/publish_s``), and add the
        transport's metrics to ``metrics``."""
        if self.version % self.cfg.sync_interval == 0:
            metrics["train/publish_s"] = metrics.get("train/publish_s", 0.0) + self.publish()
        metrics.update(self.weights.metrics())  # the transport's (raises what a publisher's thread raised)
        return metrics
