"""The inbox of the ray runtime: one Ray actor between the searchers and the trainer. A module of
its own, light to import: an actor's process imports the module that defines its class (groups
bring what their own classes need when they arrive)."""

from __future__ import annotations

import dataclasses

import ray

from tba.searcher.counters import carried_counts
from tba.types import LoggedError, SearcherReport


@ray.remote(num_cpus=0)
class Inbox:
    """Groups on their way from searchers to the trainer, and each searcher's latest counters."""

    def __init__(self, max_ahead: int | None = None) -> None:
        self.groups: list = []
        self.reports: dict[int, SearcherReport] = {}  # each searcher's latest
        self.errors: list[LoggedError] = []  # kept until drained: a newer put must not overwrite them
        self.carried: dict[int, dict[str, float]] = {}  # counts of a searcher's earlier incarnations
        self.places: dict[int, dict] = {}  # a resumed run's (:meth:`resume_places`)
        self.dropped: dict[int, list[int]] = {}  # each searcher's dropped draws since the last drain
        self.running = True
        self.max_ahead = max_ahead  # groups arrived and not yet drawn by the trainer (runtime.max_ahead)
        self.arrived = self.consumed = 0
        self.trainer_waiting = False

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def put(self, groups: list, report: SearcherReport, errors: list[LoggedError]) -> bool:
        i = report.searcher_id
        self.groups.extend(groups)
        self.arrived += len(groups)
        self.dropped.setdefault(i, []).extend(report.dropped_draws)
        last = self.reports.get(i)
        if last is not None and last.incarnation != report.incarnation:  # a restarted searcher
            self.carried[i] = carried_counts(last.metrics)  # (its streams' prompts in flight are lost)
        carried = self.carried.get(i, {})
        metrics = {**report.metrics, **{k: report.metrics.get(k, 0.0) + v for k, v in carried.items()}}
        self.reports[i] = dataclasses.replace(report, metrics=metrics, dropped_draws=[])
        self.errors.extend(errors)
        return self.running  # False tells the searcher to stop

    def resume_places(self, places: dict[int, dict]) -> None:
        """Where each searcher goes on from in a resumed run (before any starts): its place in the
        checkpoint. The prompts it had in flight there are lost, counted as such (a batch searcher
        has none)."""
        self.places = dict(places)
        for i, place in self.places.items():
            if place.get("in_flight"):
                lost = float(place["in_flight"])
                self.carried[i] = {"searcher/prompts_taken": lost, "searcher/lost_in_flight": lost}

    def place(self, searcher_id: int) -> dict | None:
        """The place searcher ``searcher_id`` goes on from (:meth:`tba.searcher.base.Searcher.place`): its
        latest put's, else a resumed run's checkpoint's; None for a searcher that starts afresh."""
        last = self.reports.get(searcher_id)
        return last.place if last is not None and last.place is not None else self.places.get(searcher_id)

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def drain(
        self, consumed: int | None = None, waiting: bool = False
    ) -> tuple[list, dict[int, SearcherReport], list[LoggedError]]:
        """Everything that arrived, and each searcher's latest report with the draws it dropped
        since the last drain; ``consumed``: the groups the trainer has drawn so far (this run);
        ``waiting``: the trainer waits for searchers (for data, or for newer weights in their data
        under the lag bound), so none may pause."""
        if consumed is not None:
            self.consumed = consumed
        self.trainer_waiting = waiting
        groups, self.groups = self.groups, []
        errors, self.errors = self.errors, []
        dropped, self.dropped = self.dropped, {}
        reports = {i: dataclasses.replace(r, dropped_draws=dropped.get(i, [])) for i, r in self.reports.items()}
        return groups, reports, errors

    @ray.method(enable_task_events=False)  # polled by a paused searcher
    def ahead(self) -> bool:
        """Whether searchers should pause: more has arrived than the trainer will draw soon."""
        if not self.running or self.max_ahead is None or self.trainer_waiting:
            return False
        return self.arrived - self.consumed >= self.max_ahead

    def stop(self) -> None:
        self.running = False
