"""The synchronous runtime: one process alternates generate-then-train (with ``trainer.num_ranks`` >
1 the training runs on trainer ranks, Ray actors that this process starts, and it waits for them).

Each step the searcher generates a fresh batch with the newest published weights and the
trainer takes one optimizer step, sampling from the replay buffer exactly as it does when the
two run asynchronously. With ``trainer.sync_interval=1`` (the default) every batch is
on-policy: the baseline that asynchronous speedups are measured against, and the mode for
debugging.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from rich.console import Console

from tba.buffer import BufferTooSmall, fresh_batch
from tba.config import Config, absolute_paths
from tba.console import RunDisplay
from tba.machine import busy_cores
from tba.metrics import MetricsLogger
from tba.models.precision import PeakMemory
from tba.plan import Plan, plan_run
from tba.runtime.build import Components, build_components
from tba.runtime.cluster import ray_session
from tba.runtime.health import FallWatch, SlowdownWatch, remedy
from tba.runtime.report import eval_key, evaluate_policy, finish, log_errors, say_event
from tba.runtime.run_dir import open_run, resume, save


def run_sync(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    """Train ``cfg`` in the sync runtime (``runtime.type`` ``sync``, or ``auto`` deciding so)."""
    return train_sync(*plan_run(absolute_paths(cfg), "sync"), console)


def train_sync(cfg: Config, plan: Plan, console: Console | None = None) -> tuple[Path, dict]:
    """Train with ``cfg`` and its ``plan`` (:func:`tba.plan.plan_run`) in the sync runtime."""
    if cfg.trainer.num_ranks > 1:  # generation here, training on ranks that Ray starts
        with ray_session(cfg, plan):
            return _run(cfg, plan, console)
    return _run(cfg, plan, console)


def _run(cfg: Config, plan: Plan, console: Console | None = None) -> tuple[Path, dict]:
    console = console or Console(stderr=True)
    start = time.time()
    if plan.trainer_threads:
        torch.set_num_threads(plan.trainer_threads)
    chatter = Console(quiet=True) if cfg.logging.quiet else console  # quiet: only errors and the summary
    cfg, run_dir, prepared, plan = open_run(cfg, chatter, plan)
    log = lambda msg: chatter.print(msg, highlight=False)  # noqa: E731
    c = build_components(cfg, plan, log, prepared=prepared)
    metrics = None
    try:
        resumed = cfg.run.resume and resume(c, run_dir, log)
        metrics = MetricsLogger(run_dir, cfg.logging, cfg.model_dump(mode="json", by_alias=True), start_time=start)
        initial = {}
        if not resumed:  # (a resume republished what the searcher loads next)
            c.trainer.publish()  # the searcher starts from the trainer's weights
            initial = evaluate_policy(c, cfg, run_dir, 0, metrics)
            metrics.log(0, initial)
        _train(c, cfg, run_dir, metrics, initial, console)
    finally:
        if metrics is not None:
            metrics.close()  # whatever happened, what was logged stays on disk
        c.close()
    return run_dir, finish(console, run_dir, c, cfg, start)


def searched(c: Components) -> list:
    """A batch from the searcher, noted in the run's account of its prompts (tba.runtime.ledger)."""
    groups = c.searcher.step()
    c.ledger.record(groups, {c.searcher.searcher_id: c.searcher.report()})
    return groups


def _train(c: Components, cfg: Config, run_dir: Path, metrics: MetricsLogger, initial: dict, console: Console) -> None:
    trainer, searcher = c.trainer, c.searcher
    fresh_only = cfg.buffer.fresh_only  # train on each step's own groups; the buffer stays empty
    min_groups = cfg.buffer.min_groups or cfg.trainer.batch_prompts
    while not fresh_only and (c.buffer.num_prompts < min_groups or not c.buffer.can_sample(cfg.trainer.batch_prompts)):
        trainer.ingest(searched(c))
        log_errors(run_dir, searcher.new_errors())
    key = eval_key(c)
    watch = FallWatch.start(key, initial, run_dir, remedy(c.plan.objective, c.plan.trust_region))
    slowdown = SlowdownWatch(c.plan.hardware, c.plan.trainer_threads, busy_cores)
    peak = PeakMemory(trainer.device)
    step_peak = 0.0  # GiB: the highest peak of the trainer's steps since the last log
    with RunDisplay.from_config(cfg.logging, cfg.trainer.steps, key) as display:
        display.update(trainer.version, initial)
        while trainer.version < cfg.trainer.steps:
            gen_start = time.perf_counter()
            groups = searched(c)
            log_errors(run_dir, searcher.new_errors())
            gen_s = time.perf_counter() - gen_start
            peak.reset()  # the trainer's step alone: generation (the engine's memory) is not the trainer's
            if fresh_only:  # repeats (if any) drawn from a per-step seed: a resume draws the same
                rng = random.Random(cfg.run.seed * 1_000_003 + trainer.version)
                try:
                    batch = fresh_batch(groups, cfg.generation.group_size, trainer.version, rng)
                except BufferTooSmall:  # every group dropped (searcher/dropped_groups): counted, not a crash
                    batch = None
                record = trainer.step(batch) if batch is not None else trainer.skip()
            else:
                trainer.ingest(groups)
                record = trainer.step()
            step_peak = max(step_peak, peak.read())
            step = trainer.version
            record["searcher/generate_s"] = gen_s
            record.update(searcher.metrics())
            record.update(c.ledger.metrics())
            if step % cfg.eval.every == 0 or step == cfg.trainer.steps:
                record.update(evaluate_policy(c, cfg, run_dir, step, metrics))
            for message in (watch.observe(step, record), slowdown.observe(gen_s + record.get("train/step_s", 0.0))):
                if message:  # on the console even when quiet
                    say_event(run_dir, lambda m: console.print(m, highlight=False, markup=False), message)
            if step % cfg.logging.every == 0 or key in record:
                record["train/peak_memory_gb"], step_peak = step_peak, 0.0  # since the previous log
                metrics.log(step, record)
            display.update(step, record)
            every = cfg.trainer.checkpoint_every
            if (every and step % every == 0) or step == cfg.trainer.steps:
                save(c, run_dir)
