"""Run directories of logged metrics, as ``tba plot`` and the docs read them."""

from __future__ import annotations

import json
from pathlib import Path

STEPS = 30


def write_run(run_dir: Path, records: list[dict], summary: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def sync_records(offset: float, log_z: bool = True) -> list[dict]:
    """A sync run's keys: an evaluation at step 0 and every 10 steps, the searcher's cumulative
    completions and no throughput key."""
    records = [{"step": 0, "time_s": 1.0, "eval/accuracy": 0.3 + offset, "eval/problems": 256.0}]
    for step in range(1, STEPS + 1):
        r = {
            "step": step,
            "time_s": 1.0 + 0.5 * step,
            "train/loss": 10.0 / step + offset,
            "train/kl": 0.01 * step,
            "train/reward_mean": 0.2,
            "train/lag_mean": 0.5,
            "train/lag_max": 1.0,
            "buffer/size": 64.0 * step,
            "searcher/completions": 128.0 * step,
            "searcher/reward_mean": 0.3 + offset + (0.1 if step % 2 else -0.1),
        }
        if log_z:
            r["train/log_z"] = 5.0 - 0.1 * step
        if step % 10 == 0:
            r["eval/accuracy"] = 0.3 + offset + 0.01 * step
        records.append(r)
    return records
