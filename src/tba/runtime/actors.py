"""The ray runtime's actors besides the weight board: searchers, the inbox their groups travel
through, and evaluation beside the trainer.

- :class:`SearcherWorker`: a searcher in its own process; it loads the newest weights between two
  generation batches and puts each batch's groups, counters and errors in the :class:`Inbox`.
- :class:`Inbox`: searchers append, the trainer takes everything at once; it keeps each
  searcher's latest counters, adding up those of a restarted searcher's earlier incarnations.
- :class:`EvalWorker` and :class:`BackgroundEvaluation` (``eval.async=true``): an actor loads the
  task, tokenizer and policy once (as ``tba eval`` does) and evaluates the weights sent with each
  request while the trainer goes on; results come back tagged with their step. At most one
  evaluation is in flight: if the next is due first, the trainer waits for it (counted in
  ``trainer/eval_wait_s``), so that every requested step is evaluated and at most one extra copy
  of the weights is held.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field

import ray
import torch

from tba.config import build_config
from tba.errors import UserError
from tba.plan import Plan
from tba.runtime.build import build_searcher, load_evaluator
from tba.runtime.components import SearcherSections
from tba.runtime.errors import CouldNotStart
from tba.runtime.policy import seed_everything
from tba.weights.ray.board import pack, unpack
from tba.weights.ray.channel import Channel, channel_receiver


@ray.remote
class SearcherWorker:
    def __init__(
        self, cfg_data: dict, plan_data: dict, searcher_id: int, names: tuple[Channel, str], driver_cwd: str = ""
    ):
        entered = time.time()  # the process has started and imported this module
        # The weights' boards and the inbox are found by name: an actor handle among the constructor's
        # arguments makes Ray warn on every run that a restart might fail (ray-project/ray#53727).
        channel, inbox = names[0], ray.get_actor(names[1])
        plan = Plan.from_dict(plan_data).in_actor(ray.get_gpu_ids())
        torch.set_num_threads(plan.searcher_threads)
        if driver_cwd and os.path.isdir(driver_cwd) and driver_cwd not in sys.path:
            sys.path.insert(0, driver_cwd)  # reward functions named as pkg.module:fn import as they do in tba train
        cfg = build_config(cfg_data)
        seed_everything(cfg.run.seed + 1000 * (searcher_id + 1))
        self.incarnation = uuid.uuid4().hex  # a restart after a crash is a new incarnation
        self.inbox = inbox
        self.start_error: UserError | None = None  # bad input met while starting: raised by run()
        try:
            weights = channel_receiver(channel, searcher_id, self.incarnation)
            sections = SearcherSections(cfg.generation, cfg.trainer, cfg.model, cfg.task, cfg.run.seed)
            self.searcher = build_searcher(sections, plan, weights, searcher_id, log=lambda msg: None)
        except UserError as err:
            self.start_error = err
            return
        self.capped = plan.max_ahead is not None  # runtime.max_ahead: ask the inbox before each batch
        self.started = {"entered": entered, "ready": time.time()}  # wall-clock, for the start-up line
        self.node = ray.get_runtime_context().get_node_id()

    def run(self) -> int:
        """Generate until the trainer says stop; returns the number of batches generated."""
        if self.start_error is not None:
            raise CouldNotStart(self.start_error)
        start, cpu, batches, paused_s = time.perf_counter(), time.process_time(), 0, 0.0
        place = ray.get(self.inbox.place.remote(self.searcher.searcher_id))
        if place is not None:  # an earlier process of this searcher's, or a checkpoint's: go on from there
            self.searcher.resume_place(place)
        while True:
            groups = self.searcher.step()
            batches += 1
            self.started.setdefault("first_batch", time.time())
            report = self.searcher.report()
            report.metrics.update(
                {
                    "tokens": self.searcher.stats.tokens,
                    "elapsed_s": time.perf_counter() - start,
                    "cpu_s": time.process_time() - cpu,
                    "searcher/paused_s": paused_s,
                }
            )
            report.incarnation, report.node, report.started = self.incarnation, self.node, dict(self.started)
            errors = self.searcher.new_errors()
            if not ray.get(self.inbox.put.remote(groups, report, errors)):
                return batches
            waited = time.perf_counter()
            while self.capped and ray.get(self.inbox.ahead.remote()):  # the trainer has enough to draw
                time.sleep(0.02)
            paused_s += time.perf_counter() - waited


@dataclass
class Finished:
    step: int
    metrics: dict[str, float]
    samples: list[dict]
    answers: list[dict] = field(default_factory=list)


@ray.remote
class EvalWorker:
    def __init__(self, cfg_data: dict, plan_data: dict, threads: int, cwd: str):
        os.chdir(cwd)  # relative paths in the config mean what they meant to the trainer
        torch.set_num_threads(threads)
        plan = Plan.from_dict(plan_data).in_actor(ray.get_gpu_ids())
        cfg = build_config(cfg_data)
        self.evaluator = load_evaluator(cfg, plan, log=lambda _: None)

    def evaluate(self, step: int, packed: dict) -> Finished:
        """Evaluate the weights :func:`tba.weights.ray.board.pack` packed (read where Ray keeps them)."""
        start = time.perf_counter()
        self.evaluator.load_weights(unpack(packed))
        result = self.evaluator()
        metrics = {**result.metrics, "eval/seconds": time.perf_counter() - start}
        return Finished(step, metrics, result.samples, result.answers)


class BackgroundEvaluation:
    """The trainer's side of the evaluation actor."""

    def __init__(self, cfg_data: dict, eval_cpus: float, plan: Plan):
        """``cfg_data``: the run's config as data, which the actor builds its evaluator from;
        ``eval_cpus``: its CPUs (``eval.eval_cpus``)."""
        self.actor = EvalWorker.options(num_cpus=eval_cpus, num_gpus=plan.eval_gpus).remote(
            cfg_data, plan.to_dict(), max(1, int(eval_cpus)), os.getcwd()
        )
        self._pending: ray.ObjectRef | None = None
        self.waited_s = 0.0  # the trainer's time spent waiting for the previous evaluation

    def submit(self, step: int, weights: dict[str, torch.Tensor] | ray.ObjectRef) -> list[Finished]:
        """Start evaluating ``weights`` as step ``step`` (a state dict, or the object-store reference
        of a publication: its copy is reused, not made again); returns the previous evaluation if
        the trainer had to wait for it (it is still running otherwise)."""
        start = time.perf_counter()
        done = self.finish()
        self.waited_s += time.perf_counter() - start
        if not isinstance(weights, ray.ObjectRef):  # packed in host memory: a CUDA tensor would need a GPU there
            weights = pack(weights)
        self._pending = self.actor.evaluate.remote(step, weights)
        return done

    def poll(self) -> list[Finished]:
        """The evaluation in flight, if it has finished; never waits."""
        if self._pending is None:
            return []
        ready, _ = ray.wait([self._pending], timeout=0)
        return self.finish() if ready else []

    def finish(self) -> list[Finished]:
        """Wait for the evaluation in flight, if any."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        return [ray.get(pending)]

    def stop(self) -> None:
        self._pending = None
        ray.kill(self.actor)
