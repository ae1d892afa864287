"""What a person watching a run sees while it trains, and the closing before/after table.

:class:`RunDisplay` has three modes, picked from the output and the ``logging`` section:

- on a terminal, a live view: a progress bar and a status line that follow every step;
- elsewhere (CI, nohup, a log file), one plain line on stderr every ``logging.line_every_s``
  seconds and one at each evaluation, such as ``step 120/600 (20%)  reward 0.41  eval 38.3%
  lag 1.2 (fresh 0.8)  replay 0.9  waited 4s  12.5 compl/s  eta 3m10s  searchers v119,v118
  restarts 0``;
- with ``logging.quiet`` or ``logging.progress=false``, nothing.

The figures: ``reward`` is the mean reward of freshly sampled completions
(``searcher/reward_mean``), not of the replayed training batch; ``eval`` is the task's evaluation
metric; ``lag`` is ``train/lag_mean`` and ``fresh`` is ``train/lag_fresh``; ``replay`` is
``train/replay_ratio`` and ``waited`` the trainer's time waiting for data so far
(``trainer/wait_total_s``, shown once it is above zero); completions per
second and the ETA are measured from the moment the display opens, evaluation pauses included
(they take wall-clock time too); ``searchers`` lists the weight version each searcher holds
(``restarting`` for one whose process died and is coming back). Time comes from an injectable
clock, so tests need not sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tba.config import LoggingConfig

# evaluation metrics that are fractions, shown as percentages
RATE_METRICS = ("eval/accuracy", "eval/win_rate", "eval/attack_success_rate")


class RunDisplay:
    """Progress of a run: a live view on a terminal, plain lines elsewhere; see the module docstring.

    Use as a context manager and call :meth:`update` after every step with that step's metrics.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        console: Console | None = None,
        eval_key: str = "eval/accuracy",
        line_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self.total = total_steps
        self.eval_key = eval_key
        self.line_every_s = line_every_s
        self.clock = clock
        self.step = 0
        self.latest: dict[str, float] = {}  # the newest finite value of every metric seen
        self.searchers: list[int | None] = []  # weight version per searcher; None while it restarts
        self._opened = clock()
        self._first_step: int | None = None
        self._completions_seen: tuple[float, float] | None = None  # (clock, count) when first reported
        self._last_line = self._opened
        self._view = Live(console=self.console, get_renderable=self._render, refresh_per_second=2)

    @classmethod
    def from_config(cls, logging: LoggingConfig, total_steps: int, eval_key: str, **kwargs) -> RunDisplay:
        """The display a run's ``logging`` section asks for: off with ``quiet`` or ``progress=false``."""
        enabled = logging.progress and not logging.quiet
        return cls(total_steps, enabled, eval_key=eval_key, line_every_s=logging.line_every_s, **kwargs)

    def __enter__(self) -> RunDisplay:
        if self.live:
            self._view.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self._view.stop()

    def update(self, step: int, metrics: dict[str, float], searchers: Sequence[int | None] | None = None) -> None:
        """Record a step's metrics; ``searchers`` is the weight version each searcher holds (None:
        restarting), by default the single ``searcher/version`` of the metrics (the sync runtime)."""
        now = self.clock()
        if self._first_step is None:
            self._first_step = step
        self.step = step
        self.latest.update({k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)})
        if searchers is not None:
            self.searchers = list(searchers)
        elif "searcher/version" in self.latest:
            self.searchers = [int(self.latest["searcher/version"])]
        if self._completions_seen is None and "searcher/completions" in self.latest:
            self._completions_seen = (now, self.latest["searcher/completions"])
        if self.enabled and not self.live and (self.eval_key in metrics or now - self._last_line >= self.line_every_s):
            self.console.print(self.line(), highlight=False, markup=False, soft_wrap=True)
            self._last_line = now

    def line(self) -> str:
        """The plain progress line: the step and every figure known so far."""
        return "  ".join([f"step {self.step}/{self.total} ({self.step / self.total:.0%})", *self.figures()])

    def figures(self) -> list[str]:
        """The figures known so far, each as ``label value``, in a fixed order."""
        m, out = self.latest, []
        if "searcher/reward_mean" in m:
            out.append(f"reward {m['searcher/reward_mean']:.2f}")
        if self.eval_key in m:
            value = m[self.eval_key]
            out.append(f"eval {value:.1%}" if self.eval_key in RATE_METRICS else f"eval {value:.3f}")
        if "train/lag_mean" in m:
            fresh = f" (fresh {m['train/lag_fresh']:.1f})" if "train/lag_fresh" in m else ""
            out.append(f"lag {m['train/lag_mean']:.1f}{fresh}")
        if "train/replay_ratio" in m and math.isfinite(m["train/replay_ratio"]):
            out.append(f"replay {m['train/replay_ratio']:.1f}")
        if m.get("trainer/wait_total_s", 0) > 0:
            out.append(f"waited {format_duration(m['trainer/wait_total_s'])}")
        rate = self.completions_per_s()
        if rate is not None:
            out.append(f"{rate:.1f} compl/s")
        eta = self.eta_s()
        if eta is not None:
            out.append(f"eta {format_duration(eta)}")
        if self.searchers:
            out.append("searchers " + ",".join("restarting" if v is None else f"v{v}" for v in self.searchers))
        if "searcher/restarts" in m:
            out.append(f"restarts {m['searcher/restarts']:.0f}")
        return out

    def completions_per_s(self) -> float | None:
        """Completions generated per second of clock since their count was first reported."""
        if self._completions_seen is None:
            return None
        since, count = self._completions_seen
        elapsed = self.clock() - since
        return (self.latest["searcher/completions"] - count) / elapsed if elapsed > 0 else None

    def eta_s(self) -> float | None:
        """Seconds until the last step at the pace of the steps taken since the display opened."""
        done = self.step - (self._first_step or 0)
        if done <= 0:
            return None
        return (self.total - self.step) * (self.clock() - self._opened) / done

    def _render(self) -> RenderableType:
        grid = Table.grid(padding=(0, 1))
        grid.add_row(
            "[bold]train",
            ProgressBar(total=self.total, completed=self.step, width=40),
            f"{self.step}/{self.total}",
            format_duration(self.clock() - self._opened),
        )
        return Group(grid, Text("  ".join(self.figures())))


def format_duration(seconds: float) -> str:
    """``45s``, ``3m10s``, ``2h05m``: short enough for a status line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def summary_table(rows: list[tuple[str, str, str]], title: str) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for row in rows:
        table.add_row(*row)
    return table
