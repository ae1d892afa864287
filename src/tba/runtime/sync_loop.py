"""The synchronous runtime: one process alternates generate-then-train (with ``trainer.num_ranks`` >
1 the training runs on trainer ranks, Ray actors that this process starts, and it waits for them).

Each step the searcher generates a fresh batch with the newest published weights and the
trainer takes one optimizer step, sampling from the replay buffer exactly as it does when the
two run asynchronously. With ``trainer.sync_interval=1`` (the default) every batch is
on-policy: the baseline that asynchronous speedups are measured against, and the mode for
debugging.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch
from rich.console import Console

from tba.config import Config, absolute_paths
from tba.machine import busy_cores
from tba.metrics import MetricsLogger
from tba.plan import Plan, plan_run
from tba.runtime.build import build_components
from tba.runtime.cluster import ray_session
from tba.runtime.health import SlowdownWatch
from tba.runtime.report import evaluate_policy, finish, say_event
from tba.runtime.run_dir import open_run, resume
from tba.runtime.sources import LocalSource
from tba.runtime.steps import LoopSections, train_steps


def run_sync(cfg: Config, console: Console | None = None, plan: Plan | None = None) -> tuple[Path, dict]:
    """Train ``cfg`` in the sync runtime (``runtime.type`` ``sync``, or ``auto`` deciding so); with
    ``plan``, ``cfg`` is the config :func:`tba.plan.plan_run` returned with it (``tba train``)."""
    if plan is None:
        cfg, plan = plan_run(absolute_paths(cfg), "sync")
    console = console or Console(stderr=True)
    start = time.time()
    if plan.trainer_threads:
        torch.set_num_threads(plan.trainer_threads)
    chatter = Console(quiet=True) if cfg.logging.quiet else console  # quiet: only errors and the summary
    with ExitStack() as closing:
        if cfg.trainer.num_ranks > 1:  # generation here, training on ranks that Ray starts
            closing.enter_context(ray_session(cfg.runtime, plan))
        cfg, run_dir, prepared, plan = open_run(cfg, chatter, plan)
        log = lambda msg: chatter.print(msg, highlight=False)  # noqa: E731
        say = lambda m: say_event(run_dir, lambda m: console.print(m, highlight=False, markup=False), m)  # noqa: E731
        c = build_components(cfg, plan, log, prepared=prepared)
        closing.callback(c.close)
        resumed = cfg.run.resume and resume(c, run_dir, log)
        metrics = MetricsLogger(run_dir, cfg.logging, cfg.model_dump(mode="json", by_alias=True), start_time=start)
        closing.callback(metrics.close)  # whatever happened, what was logged stays on disk
        initial = {}
        if not resumed:  # (a resume republished what the searcher loads next)
            c.trainer.publish()  # the searcher starts from the trainer's weights
            initial = evaluate_policy(c, run_dir, 0, metrics)
            metrics.log(0, initial)
        g = cfg.generation
        source = LocalSource(c, run_dir, cfg.buffer.fresh_only, g.group_size, cfg.run.seed)
        slowdown = SlowdownWatch(c.plan.hardware, c.plan.trainer_threads, busy_cores)
        sections = LoopSections(cfg.trainer, cfg.buffer, g, cfg.logging, cfg.eval.every)
        extra = train_steps(c, sections, run_dir, metrics, initial, source, slowdown, say, log=log)
    return run_dir, finish(console, run_dir, c, start, extra)
