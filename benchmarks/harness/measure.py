"""In-process measurement: one trainer step's time and peak memory, and a measurement taken in a
fresh interpreter (so that none inherits another's heap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


def fresh_row(cmd: list, what: str) -> dict:
    """Run ``cmd`` (its items made strings) in a fresh interpreter with :data:`MALLOC_ENV`; its last
    stdout line is a JSON row. A failure raises RuntimeError naming ``what``, with its last error."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
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
    prepared = prepare_task(cfg, lambda msg: None)
    cfg, plan = plan_run(cfg)
    plan = ready_plan(cfg, plan, prepared[1], lambda msg: None, task=prepared[0])
    c = build_components(cfg, plan, lambda msg: None, prepared=prepared)
    c.trainer.publish()
    return cfg, c
