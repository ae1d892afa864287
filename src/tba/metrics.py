"""Metric sinks: ``metrics.jsonl`` always (one JSON object per line, each with ``step`` and
``time_s``), TensorBoard when asked for."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = False, start_time: float | None = None):
        self.start = time.time() if start_time is None else start_time
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses nothing written
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError(
                    "logging.tensorboard=true needs the tensorboard package: pip install tensorboard"
                ) from err
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        record = {"step": step, "time_s": round(time.time() - self.start, 3)}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None  # JSON has no NaN
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (a partly written last line is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
