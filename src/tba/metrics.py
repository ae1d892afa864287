"""Metric sinks of a run: ``metrics.jsonl`` always (one JSON object per line, each with ``step`` and
``time_s``); TensorBoard (``logging.tensorboard``) and Weights & Biases (``logging.wandb``) beside it
when asked for.

Every record goes to every sink with the trainer step as its x axis and the wall-clock ``time_s`` as
one more metric. So do the completions of each evaluation (the records of ``samples.jsonl``): a
markdown table in TensorBoard's text tab, a W&B Table, both under ``eval/samples``. W&B tables
cannot change once logged, so each evaluation logs its own, at its step.

W&B's own step only grows: it drops what is logged at an earlier step. Evaluations can arrive late
(the evaluation actor of ``eval.async=true`` reports at the step whose weights it evaluated), and a
resume trains again the steps after its checkpoint. So every W&B record carries the trainer step
as the metric ``trainer/step``, the x axis of every other metric (``define_metric``), and W&B
numbers its rows as it likes.

The optional packages are imported only when their sink is on. :func:`check_backends` imports them
before the run directory exists, so that a missing one stops the start with a
:class:`~tba.errors.MissingDependency` that names the pip command. A W&B run keeps its files in
``<run>/wandb`` and its id in ``<run>/wandb_id``: a resumed run (``run.resume=true``) continues the
same W&B run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tba.config import LoggingConfig
from tba.errors import MissingDependency, UserError
from tba.machine import describe_machine

SAMPLES_KEY = "eval/samples"
"""Where the sinks show an evaluation's completions."""
WANDB_STEP = "trainer/step"
"""The W&B metric that holds the trainer step: the x axis of all others."""
ENVIRONMENT_KEY = "environment"
"""Where TensorBoard shows the machine the run ran on (:func:`tba.machine.describe_machine`)."""


def check_backends(logging: LoggingConfig) -> None:
    """Import the packages of the sinks that ``logging`` turns on; raise :class:`MissingDependency`
    for one that is not installed."""
    if logging.tensorboard:
        _summary_writer_class()
    if logging.wandb:
        _import_wandb()


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise MissingDependency(
            "logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or pip install 'tba[tensorboard]')"
        ) from err
    return SummaryWriter


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise MissingDependency(
            "logging.wandb=true needs the wandb package: pip install wandb (or pip install 'tba[wandb]')"
        ) from err
    return wandb


class MetricsLogger:
    """Writes each record to ``<run>/metrics.jsonl`` and to the sinks that ``logging`` turns on.

    ``run_config`` is the resolved config (``cfg.model_dump(mode="json", by_alias=True)``), shown as
    the W&B run's config with the machine (:func:`tba.machine.describe_machine`) under
    ``environment``; TensorBoard shows the machine as a table in its text tab. Call :meth:`close` on every exit path."""

    def __init__(
        self,
        run_dir: Path | str,
        logging: LoggingConfig | None = None,
        run_config: dict | None = None,
        start_time: float | None = None,
    ):
        logging = logging or LoggingConfig()
        check_backends(logging)  # before anything is written: a missing package leaves no trace
        run_dir = Path(run_dir)
        self.start = time.time() if start_time is None else start_time
        environment = describe_machine()  # where the run ran, beside its config in W&B and TensorBoard
        run_config = {**(run_config or {}), "environment": environment}
        self._wandb = _start_wandb(run_dir, logging, run_config) if logging.wandb else None
        self._tb = _summary_writer_class()(str(run_dir / "tensorboard")) if logging.tensorboard else None
        if self._tb is not None:
            rows = [[key, value] for key, value in environment.items()]
            self._tb.add_text(ENVIRONMENT_KEY, _markdown_table(["", "environment"], rows), 0)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses nothing written

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Write one record at trainer step ``step``; returns the record of ``metrics.jsonl``."""
        values = {"time_s": round(time.time() - self.start, 3), **{k: float(v) for k, v in metrics.items()}}
        record = {"step": step, **{k: v if math.isfinite(v) else None for k, v in values.items()}}  # JSON has no NaN
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({WANDB_STEP: step, **values})
        return record

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Show an evaluation's completions (the records of ``samples.jsonl``: prompt, completion,
        score, answer, ...) at ``step`` in TensorBoard and W&B; ``metrics.jsonl`` takes none."""
        if not samples or (self._tb is None and self._wandb is None):
            return
        columns = ["step", *dict.fromkeys(key for s in samples for key in s if key != "step")]
        rows = [[step, *(_cell(s.get(key)) for key in columns[1:])] for s in samples]
        if self._tb is not None:
            self._tb.add_text(SAMPLES_KEY, _markdown_table(columns, rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
            self._wandb.log({WANDB_STEP: step, SAMPLES_KEY: table})

    def close(self) -> None:
        """Flush and close every sink. Called while an exception propagates (from a ``finally``:
        Ctrl-C, a crash), it finishes the W&B run as failed (exit code 1) rather than as done."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if sys.exc_info()[0] is None else 1)
            self._wandb = None


def _start_wandb(run_dir: Path, logging: LoggingConfig, run_config: dict) -> Any:
    """A W&B run with its files in ``<run>/wandb``: the run of ``<run>/wandb_id`` if a former start
    of this run directory wrote one (a resume), else a new one whose id goes there."""
    wandb = _import_wandb()
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    try:
        run = wandb.init(
            project=logging.wandb_project,
            entity=logging.wandb_entity,
            name=logging.wandb_name or run_dir.name,
            tags=list(logging.wandb_tags),
            config=run_config,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
        )
    except wandb.errors.UsageError as err:  # no API key, a bad entity or project: the user's to fix
        raise UserError(f"logging.wandb=true: {err} (or set WANDB_MODE=offline to log without an account)") from err
    id_file.write_text(run.id + "\n")
    run.define_metric(WANDB_STEP)
    run.define_metric("*", step_metric=WANDB_STEP)
    return run


def _cell(value: Any) -> Any:
    """A table cell: numbers stay numbers, anything else is shown as text."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return str(value)


def _markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (what TensorBoard's text tab renders); cells on one line, ``|`` escaped."""

    def text(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (a partly written last line is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
