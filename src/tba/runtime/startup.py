"""Where a ray run's time goes before its first trainer step (:class:`StartUp`): printed once as a
``start-up:`` line and saved in ``summary.json`` as ``startup_s``."""

from __future__ import annotations

import time

from tba.types import SearcherReport


class StartUp:
    """The seconds from the start of a run to its first trainer step, by phase, in order; and from
    the searchers' creation to their first batch, by phase of the first searcher to deliver one
    (its process and imports, its models, the batch: the searchers start while this process
    publishes and evaluates)."""

    def __init__(self, start: float) -> None:
        self.last = self.start = start
        self.phases: dict[str, float] = {}
        self.searcher_phases: dict[str, float] = {}
        self.created: float | None = None
        self.done = False

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = round(now - self.last, 3)
        self.last = now
        self.created = now if phase == "starting searchers" else self.created
        self.done = phase == "first step"

    def searcher(self, reports: dict[int, SearcherReport]) -> None:
        """The searcher side, from the stats of the searcher that delivered first (same machine's clock)."""
        first = [r.started for r in reports.values() if "first_batch" in r.started]
        if not first or self.created is None:
            return
        s = min(first, key=lambda s: s["first_batch"])
        times = (self.created, s["entered"], s["ready"], s["first_batch"])
        names = ("process and imports", "models", "first batch")
        spans = zip(names, times[:-1], times[1:], strict=True)
        self.searcher_phases = {n: round(max(0.0, b - a), 3) for n, a, b in spans}

    def line(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases.items())
        line = f"start-up: first step {self.last - self.start:.1f} s after the start ({parts})"
        if self.searcher_phases:
            line += "; the searcher: " + ", ".join(f"{p} {v:.1f} s" for p, v in self.searcher_phases.items())
        return line

    def summary(self) -> dict:
        return {**self.phases, **{f"searcher: {k}": v for k, v in self.searcher_phases.items()}}
