"""What a searcher reports with each batch, declared once. Each :class:`Counter` names its metric,
how a run with several searchers combines their values (``reduce``), and whether a restarted
searcher's earlier incarnations' counts carry on (``cumulative``: the inbox adds them). The
searcher (:meth:`tba.searcher.Searcher.metrics`), the ray runtime's inbox and its loop all read
:data:`COUNTERS`; ``tests/test_counters.py`` fails when a searcher reports a key not declared here,
or leaves out one that is, so a renamed counter is a failing test, not a silent zero.

Reductions: ``sum``, ``max``, ``min``, ``mean``, ``median``, ``finite_mean`` (the mean of the finite
values; none: left out), ``per_completion`` (the mean weighted by each searcher's completions), and
None (per searcher only: the loop reads it itself, the run's metrics do not carry it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Counter:
    key: str  # one searcher's metric
    reduce: str | None  # how the run combines the searchers' values (None: not a run metric)
    cumulative: bool = False  # a restarted searcher's earlier counts carry on
    optional: bool = False  # reported by some searchers only (multi-turn, streaming, a transport's receiver)
    run_key: str | None = None  # the run's metric, where its name differs


COUNTERS: tuple[Counter, ...] = (
    Counter("searcher/completions", "sum", cumulative=True),
    Counter("searcher/empty_completions", "sum", cumulative=True),
    Counter("searcher/unfinished", "sum", cumulative=True),
    Counter("searcher/dropped_groups", "sum", cumulative=True),
    Counter("searcher/reward_timeouts", "sum", cumulative=True),
    Counter("searcher/reward_errors", "sum", cumulative=True),
    Counter("searcher/reward_non_finite", "sum", cumulative=True),
    Counter("searcher/no_reward", "sum", cumulative=True),
    Counter("searcher/engine_busy", "mean"),
    Counter("searcher/version", "min", run_key="searcher/version_min"),
    Counter("searcher/reference_tokens_per_s", "sum"),
    Counter("searcher/reward_mean", "finite_mean"),
    Counter("weights/fetch_s", "max"),  # the slowest searcher's latest weight update
    Counter("weights/load_s", "max"),
    # multi-turn rollouts (task.tools, task.environment)
    Counter("searcher/turns_per_conversation", "per_completion", optional=True),
    Counter("searcher/tool_calls", "sum", cumulative=True, optional=True),
    Counter("searcher/tool_errors", "sum", cumulative=True, optional=True),
    Counter("searcher/tool_timeouts", "sum", cumulative=True, optional=True),
    Counter("searcher/environment_errors", "sum", cumulative=True, optional=True),
    # streaming searchers
    Counter("searcher/prompts_taken", "sum", cumulative=True, optional=True),
    Counter("searcher/groups_sent", "sum", cumulative=True, optional=True),
    Counter("searcher/in_flight", "sum", optional=True),
    Counter("searcher/lost_in_flight", "sum", cumulative=True, optional=True),  # the inbox counts them
    Counter("searcher/versions_per_group", "finite_mean", optional=True),
    Counter("searcher/group_latency_p50_s", "median", optional=True),  # the typical searcher's median
    Counter("searcher/group_latency_p95_s", "max", optional=True),  # the slowest searcher's tail
    # the weight transports' receivers (tba.weights.ray)
    Counter("weights/received", "sum", cumulative=True, optional=True),
    Counter("weights/join_failures", "sum", cumulative=True, optional=True),
    Counter("weights/receive_failures", "sum", cumulative=True, optional=True),
    Counter("weights/slot_copies", "sum", cumulative=True, optional=True),
    # added by the ray runtime's searcher actor
    Counter("tokens", None, cumulative=True),
    Counter("elapsed_s", None, cumulative=True),
    Counter("cpu_s", None, cumulative=True),  # the searcher process's CPU seconds, every thread's
    Counter("searcher/paused_s", "sum", cumulative=True),
)
BY_KEY = {c.key: c for c in COUNTERS}
PER_FUNCTION = "reward/"  # each reward function's latest mean (``reward/<name>_mean``): finite_mean
ACTOR_KEYS = ("tokens", "elapsed_s", "cpu_s", "searcher/paused_s")  # what the actor adds, not the searcher


def declared(key: str) -> bool:
    return key in BY_KEY or key.startswith(PER_FUNCTION)


def carried_counts(last: dict[str, float]) -> dict[str, float]:
    """The cumulative counts of a searcher's incarnation that ended (the inbox adds them to the
    next one's); the prompts a streaming searcher had in flight are lost with it."""
    out = {c.key: last[c.key] for c in COUNTERS if c.cumulative and c.key in last}
    if "searcher/in_flight" in last:
        out["searcher/lost_in_flight"] = last["searcher/in_flight"] + last.get("searcher/lost_in_flight", 0.0)
    return out


def _finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def combine(reports: list[dict]) -> dict[str, float]:
    """The run's metrics from each searcher's latest report: every declared counter by its
    reduction, the rates over the longest-running searcher's time, each reward function's mean."""
    if not reports:
        return {}
    out: dict[str, float] = {}
    completions = [r["searcher/completions"] for r in reports]
    for c in COUNTERS:
        if c.reduce is None:
            continue
        present = [r for r in reports if c.key in r] if c.optional else reports
        if not present:
            continue
        values = [r[c.key] for r in present]  # a declared counter a searcher left out: KeyError
        if c.reduce == "per_completion":
            weighted = sum(v * r["searcher/completions"] for v, r in zip(values, present, strict=True))
            value = weighted / max(sum(completions), 1.0)
        elif c.reduce == "finite_mean":
            value = _finite_mean(values)
        elif c.reduce == "median":
            value = statistics.median(values)
        elif c.reduce == "mean":
            value = sum(values) / len(values)
        else:
            value = {"sum": sum, "max": max, "min": min}[c.reduce](values)
        if value is not None:
            out[c.run_key or c.key] = float(value)
    elapsed = max(r["elapsed_s"] for r in reports)
    out["searcher/completions_per_s"] = sum(completions) / max(elapsed, 1e-9)
    out["searcher/tokens_per_s"] = sum(r["tokens"] for r in reports) / max(elapsed, 1e-9)
    # the CPU seconds a completion took, every thread of the searchers' processes (their pauses' polling included)
    out["searcher/cpu_per_completion_s"] = sum(r["cpu_s"] for r in reports) / max(sum(completions), 1.0)
    # and its seconds, the pauses under runtime.max_ahead left out: a batch's, as a searcher's own calls take it
    active = sum(r["elapsed_s"] - r["searcher/paused_s"] for r in reports)
    out["searcher/active_s_per_completion"] = active / max(sum(completions), 1.0)
    for key in sorted({k for r in reports for k in r if k.startswith(PER_FUNCTION)}):
        value = _finite_mean([r[key] for r in reports if key in r])
        if value is not None:
            out[key] = value
    return out
