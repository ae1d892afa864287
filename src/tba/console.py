"""What a person watching a run sees: a progress bar with the latest figures, and a closing
before/after table. Off a terminal (CI, a log file) it prints one plain line per evaluation."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class RunDisplay:
    def __init__(
        self, total_steps: int, enabled: bool = True, console: Console | None = None, eval_key: str = "eval/accuracy"
    ):
        self.eval_key = eval_key
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self.total = total_steps
        self.figures: dict[str, str] = {}
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[figures]}"),
            console=self.console,
            disable=not self.live,
        )
        self._task = self._progress.add_task("train", total=total_steps, figures="")

    def __enter__(self) -> RunDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        shown = {
            "train/loss": ("loss", "{:.3g}"),
            "train/reward_mean": ("reward", "{:.2f}"),
            self.eval_key: ("eval", "{:.1%}" if self.eval_key == "eval/accuracy" else "{:.3f}"),
            "train/lag_mean": ("lag", "{:.1f}"),
        }
        for key, (label, fmt) in shown.items():
            if metrics.get(key) is not None:
                self.figures[label] = fmt.format(metrics[key])
        text = "  ".join(f"{k} {v}" for k, v in self.figures.items())
        self._progress.update(self._task, completed=step, figures=text)
        if not self.live and self.enabled and self.eval_key in metrics:
            print(f"step {step}/{self.total}  {text}", file=sys.stderr, flush=True)


def summary_table(rows: list[tuple[str, str, str]], title: str) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for row in rows:
        table.add_row(*row)
    return table
