"""The two rollout sources of :func:`tba.runtime.loop.train_loop`.

- :class:`LocalSource` (the sync runtime): the searcher in this process generates a batch when the
  loop asks for one, with the newest published weights (generate-then-train).
- :class:`InboxSource` (the ray runtime): searcher actors put their groups in an inbox actor; the
  source drains it and waits while the replay or the staleness bound holds the trainer
  (:mod:`tba.runtime.bounds`), checking on the searchers (:class:`tba.runtime.restarts.SearcherPool`).

Both put what arrives in the trainer's replay buffer and note it in the run's prompt ledger.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import ray

from tba.buffer import BufferTooSmall, fresh_batch
from tba.runtime.bounds import Starvation, StepGate
from tba.runtime.fill import Fill
from tba.runtime.loop import Delivery
from tba.runtime.report import log_errors
from tba.searcher.counters import combine
from tba.types import SearcherReport


class LocalSource:
    def __init__(self, c, run_dir: Path, fresh_only: bool, group_size: int, seed: int) -> None:
        """``fresh_only`` (``buffer.fresh_only``): each step trains on its own groups, the buffer unused."""
        self.c, self.run_dir = c, run_dir
        self.fresh_only, self.group_size, self.seed = fresh_only, group_size, seed
        self.report: SearcherReport | None = None  # the searcher's latest

    def _search(self) -> tuple[list, SearcherReport]:
        """A batch from the searcher and its report, noted in the ledger."""
        searcher = self.c.searcher
        groups = searcher.step()
        self.report = searcher.report()  # (its counters are the step's record's)
        self.c.ledger.record(groups, {searcher.searcher_id: self.report})
        log_errors(self.run_dir, searcher.new_errors())
        return groups, self.report

    def fill(self, fill: Fill) -> None:
        while not fill.ready():
            groups, report = self._search()
            self.c.trainer.ingest(groups)
            fill.observe(len(groups), len(report.dropped_draws), report.metrics)

    def next(self, version: int) -> Delivery:
        start, cpu = time.perf_counter(), time.process_time()
        groups, _ = self._search()
        gen_s = time.perf_counter() - start
        metrics = {"searcher/generate_s": gen_s, "searcher/generate_cpu_s": time.process_time() - cpu}
        if not self.fresh_only:
            self.c.trainer.ingest(groups)
            return Delivery(generate_s=gen_s, metrics=metrics)
        rng = random.Random(self.seed * 1_000_003 + version)  # repeats from a per-step seed: a resume draws the same
        try:
            return Delivery(batch=fresh_batch(groups, self.group_size, version, rng), generate_s=gen_s, metrics=metrics)
        except BufferTooSmall:  # every group dropped (searcher/dropped_groups): counted, not a crash
            return Delivery(empty=True, generate_s=gen_s, metrics=metrics)

    def stepped(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {**self.report.metrics, **self.c.ledger.metrics()}

    def versions(self) -> None:
        return None

    def summary(self) -> dict:
        return {}


class InboxSource:
    def __init__(self, c, inbox, pool, run_dir: Path, gate: StepGate, batch_prompts: int, startup, log) -> None:
        """``inbox``: the :class:`tba.runtime.inbox.Inbox` actor; ``pool``: the searchers; ``startup``:
        the run's :class:`tba.runtime.startup.StartUp`, marked at the fill's end and the first step."""
        self.c, self.inbox, self.pool, self.run_dir, self.gate = c, inbox, pool, run_dir, gate
        self.batch_prompts, self.startup, self.log = batch_prompts, startup, log
        self.reports: dict[int, SearcherReport] = {}  # each searcher's latest
        self.first = c.trainer.version  # (a resumed run's: the inbox counts from its start)
        self.starved = Starvation()

    def _drain(self, consumed: int | None = None, waiting: bool = False) -> tuple[int, int]:
        """Take what arrived into the buffer; the groups taken and the prompts the searchers dropped."""
        groups, reports, errors = ray.get(self.inbox.drain.remote(consumed, waiting))
        self.c.ledger.record(groups, reports)
        self.c.trainer.ingest(groups)
        self.gate.add_arrivals(sum(g.size for g in groups))
        log_errors(self.run_dir, errors)
        self.reports = reports or self.reports
        return len(groups), sum(len(r.dropped_draws) for r in reports.values())

    def _counters(self) -> dict[str, float]:
        """The run's figures from every searcher's latest counters (:func:`tba.searcher.counters.combine`)."""
        return combine([r.metrics for r in self.reports.values()])

    def fill(self, fill: Fill) -> None:
        while not fill.ready():
            self.pool.check()
            groups, dropped = self._drain(waiting=True)
            fill.observe(groups, dropped, self._counters())
            time.sleep(0.05)
        self.startup.mark("waiting for the first batch")
        self.startup.searcher(self.reports)

    def next(self, version: int) -> Delivery:
        consumed = (version - self.first) * self.batch_prompts  # what searchers may run ahead of (runtime.max_ahead)
        self._drain(consumed)
        self.pool.check()
        wait_start = time.perf_counter()
        self.starved.begin(wait_start, self.gate.arrived, self._generated())
        # the bounds: wait for data; a restarting searcher (None) does not count
        while self.gate.blocked(version, [v for v in self._versions(oldest=True) if v is not None]):
            time.sleep(0.02)
            self.pool.check()
            self._drain(consumed, waiting=True)
            if message := self.starved.check(time.perf_counter(), self.gate.arrived, self._generated()):
                self.pool.log(message)  # on the console even when quiet, and in errors.log
        wait_s = time.perf_counter() - wait_start
        return Delivery(wait_s=wait_s, metrics={"train/replay_ratio": self.gate.replay_ratio()})

    def stepped(self) -> None:
        self.gate.stepped()
        if not self.startup.done:
            self.startup.mark("first step")
            self.log(self.startup.line())

    def _generated(self) -> float:
        """Completions the searchers have generated so far (kept or dropped), by their latest reports."""
        return sum(r.metrics["searcher/completions"] for r in self.reports.values())

    def _versions(self, oldest: bool = False) -> list[int | None]:
        """The weight version each searcher holds, by its latest report (``oldest``: the oldest a
        group it sends from now on can start from); None while it restarts."""
        pool, reports = self.pool, self.reports

        def version(r: SearcherReport) -> int:
            return r.oldest_version if oldest else int(r.metrics["searcher/version"])

        return [None if i in pool.waiting else version(reports[i]) for i in sorted({*reports, *pool.waiting})]

    def metrics(self) -> dict[str, float]:
        return {
            **self._counters(),  # every searcher's counters (tba.searcher.counters)
            **self.c.ledger.metrics(),
            "searcher/restarts": float(self.pool.restarts),
        }

    def versions(self) -> list[int | None]:
        return self._versions()

    def summary(self) -> dict:
        return {
            "searcher_nodes": sorted({r.node for r in self.reports.values()}),
            "searcher_restarts": self.pool.restarts,
            "replay_ratio": round(self.gate.trained / max(self.gate.arrived, 1), 4),  # over the whole run
            "startup_s": self.startup.summary(),
        }
