"""Killing a run where it holds something to lose: the prompt accounting test and
``benchmarks/bench_scale_faults.py`` stop ``tba train`` where it has taken in groups since its
latest checkpoint, which a resume must then have drawn again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tba.checkpoint import latest_checkpoint
from tba.metrics import read_metrics


def steps_done(run_dir: Path) -> int:
    """The trainer steps ``run_dir``'s metrics hold so far."""
    path = Path(run_dir) / "metrics.jsonl"
    return sum(1 for r in read_metrics(path) if "train/loss" in r) if path.is_file() else 0


def drawn_at(run_dir: Path, step: int | None) -> float:
    """``prompts/drawn`` in ``run_dir``'s metrics at ``step`` (None: the latest), -1 before it is."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [r for r in read_metrics(path) if "prompts/drawn" in r] if path.is_file() else []
    found = [r["prompts/drawn"] for r in records if step is None or r["step"] == step]
    return found[-1] if found else -1.0


def frozen_after_new_groups(pid: int, run_dir: Path) -> bool:
    """Stop process ``pid`` (SIGSTOP) and keep it stopped if its run has logged more prompts drawn
    than at its latest checkpoint (True), else let it go on (False). Stopped, what it logged and
    saved cannot move between the check and a kill."""
    os.kill(pid, signal.SIGSTOP)
    latest = latest_checkpoint(run_dir)
    if latest is not None and drawn_at(run_dir, int(latest.name.split("_")[1])) < drawn_at(run_dir, None):
        return True
    os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)
    return False
