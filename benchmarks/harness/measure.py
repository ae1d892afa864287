"""In-process measurement: one trainer step's time and peak memory, a sync run's parts and a round of
them timed one by one, and a measurement taken in a fresh interpreter (so that none inherits
another's heap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc serves allocations above this from mmap and unmaps them on free, so the resident size
follows the tensors that are alive; its default threshold grows to 32 MiB after large frees and
then keeps freed blocks in the heap, where a later measurement's peak would hide in reused memory."""


def timed_steps(trainer, batch, device, repeats: int) -> tuple[list, list]:
    """Seconds and peak memory (bytes over what was held before it) of each of ``repeats`` steps of
    ``trainer`` on ``batch``: the resident set's peak on a CPU, CUDA's peak allocated bytes on a GPU."""
    import torch

    from tba.models.precision import PeakMemory, cpu_peak_rss_bytes, cpu_rss_bytes

    cuda = device.type == "cuda"
    peak = PeakMemory(device)
    seconds, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        peak.reset()  # VmHWM := the resident size now (CUDA: the peak := what is allocated now)
        base = torch.cuda.memory_allocated(device) if cuda else cpu_rss_bytes()
        start = time.perf_counter()
        trainer.step(batch)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        peaks.append((torch.cuda.max_memory_allocated(device) if cuda else cpu_peak_rss_bytes()) - base)
    return seconds, peaks


def fresh_row(cmd: list, what: str, env: Mapping[str, str] = MALLOC_ENV, show_stderr: bool = False) -> dict:
    """Run ``cmd`` (its items made strings) in a fresh interpreter with ``env`` (:data:`MALLOC_ENV`
    unless told otherwise) over this process's environment; its last stdout line is a JSON row.
    ``show_stderr``: its stderr goes to this process's as it runs instead of being kept for the error.
    A failure raises RuntimeError naming ``what``, with its last error."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=None if show_stderr else subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{(proc.stderr or '(its stderr is above)')[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hog() -> subprocess.Popen:
    """A process that keeps one core busy until it is stopped (a loaded machine's other process)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def sync_components(path: str | None, overrides: list[str]):
    """A sync run's parts in this process (the searcher, the trainer, the buffer), built as ``tba
    train`` builds them from the config at ``path`` (None: the demo) with ``overrides``, the trainer's
    first weights published, for benchmarks that time a step's parts one by one."""
    from tba.config import load_config
    from tba.plan import plan_run
    from tba.runtime.build import build_components
    from tba.runtime.preflight import prepare_task, ready_plan

    cfg = load_config(path, ["--runtime.type=sync", *overrides])
    prepared = prepare_task(cfg.model, cfg.task, cfg.objective, cfg.eval.samples, lambda msg: None)
    cfg, plan = plan_run(cfg)
    plan = ready_plan(cfg.model, cfg.generation, cfg.task, plan, prepared[1], lambda msg: None, task=prepared[0])
    c = build_components(cfg, plan, lambda msg: None, prepared=prepared)
    c.trainer.publish()
    return cfg, c


def fill_buffer(c, batches: int) -> None:
    """Feed ``batches`` of the searcher's to the trainer of :func:`sync_components`' parts ``c``,
    untimed: a buffer that can fill a batch of distinct prompts with contrast."""
    for _ in range(batches):
        c.trainer.ingest(c.searcher.step())


class Round(NamedTuple):
    """One searcher batch and one trainer step, timed apart (:func:`timed_round`)."""

    groups: list
    """The batch's groups."""
    batch_s: float
    """Seconds of the searcher's batch (generation, rewards, reference log-probs)."""
    metrics: dict
    """The trainer step's metrics."""
    train_s: float
    """Seconds of the trainer step (a batch from the buffer, forward and backward, the optimizer)."""


def timed_round(c) -> Round:
    """A searcher batch of :func:`sync_components`' parts ``c``, fed to the trainer (untimed), then a
    trainer step."""
    start = time.perf_counter()
    groups = c.searcher.step()
    batch_s = time.perf_counter() - start
    c.trainer.ingest(groups)
    start = time.perf_counter()
    metrics = c.trainer.step()
    return Round(groups, batch_s, metrics, time.perf_counter() - start)
