"""Evaluation beside the trainer (``eval.async=true``, ray runtime).

An :class:`EvalWorker` actor loads the task, tokenizer and policy once (as ``tba eval`` does,
with the same :class:`tba.evaluation.Evaluator`), and evaluates the weights the trainer sends
with each request. :class:`BackgroundEvaluation` is the trainer's side: it sends the weights of
the step to evaluate and goes on training; results come back tagged with their step and are
logged at that step. At most one evaluation is in flight: if the next one is due before the
last has finished, the trainer waits for it (counted in ``trainer/eval_wait_s``), so that every
requested step is evaluated and at most one extra copy of the weights is held.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
import torch

from tba.config import Config
from tba.runtime.gpus import actor_config
from tba.weights import to_host


@dataclass
class Finished:
    step: int
    metrics: dict[str, float]
    samples: list[dict]


@ray.remote
class EvalWorker:
    def __init__(self, cfg_data: dict, threads: int, cwd: str):
        os.chdir(cwd)  # relative paths in the config mean what they meant to the trainer
        torch.set_num_threads(threads)
        from tba.runtime.components import load_evaluator

        cfg = actor_config(cfg_data, ray.get_gpu_ids())
        self.evaluator = load_evaluator(cfg, log=lambda _: None, gpu_share=cfg.eval.eval_gpus)

    def evaluate(self, step: int, weights: dict[str, torch.Tensor]) -> Finished:
        start = time.perf_counter()
        self.evaluator.load_weights(weights)
        result = self.evaluator()
        metrics = {**result.metrics, "eval/seconds": time.perf_counter() - start}
        return Finished(step, metrics, result.samples)


class BackgroundEvaluation:
    """The trainer's side of the evaluation actor."""

    def __init__(self, cfg: Config):
        e = cfg.eval
        self.actor = EvalWorker.options(num_cpus=e.eval_cpus, num_gpus=e.eval_gpus).remote(
            cfg.model_dump(mode="json", by_alias=True), max(1, int(e.eval_cpus)), os.getcwd()
        )
        self._pending: ray.ObjectRef | None = None
        self.waited_s = 0.0  # the trainer's time spent waiting for the previous evaluation

    def submit(self, step: int, weights: dict[str, torch.Tensor]) -> list[Finished]:
        """Start evaluating ``weights`` as step ``step``; returns the previous evaluation if the
        trainer had to wait for it (it is still running otherwise)."""
        start = time.perf_counter()
        done = self.finish()
        self.waited_s += time.perf_counter() - start
        self._pending = self.actor.evaluate.remote(step, to_host(weights))  # a CUDA tensor would need a GPU there
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
