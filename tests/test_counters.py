"""The searchers' counters, declared once (``tba.searcher.counters``): how a run combines several
searchers' reports, and what a restarted searcher's earlier incarnations carry over."""

from __future__ import annotations

import math

import pytest

from tba.searcher.counters import COUNTERS, carried_counts, combine


def report(completions: float, version: float, **extra) -> dict:
    """One searcher's report with every counter declared for all searchers."""
    base = {c.key: 0.0 for c in COUNTERS if not c.optional}
    base.update({"searcher/completions": completions, "searcher/version": version, "tokens": 10 * completions})
    base.update(extra)
    return base


def test_several_searchers_combine_by_each_counters_reduction():
    a = report(
        30,
        4,
        **{
            "elapsed_s": 10.0,
            "searcher/paused_s": 4.0,  # under runtime.max_ahead
            "cpu_s": 6.0,
            "searcher/engine_busy": 0.5,
            "searcher/reward_mean": 0.2,
            "weights/load_s": 0.3,
            "searcher/turns_per_conversation": 2.0,
            "searcher/group_latency_p50_s": 1.0,
            "searcher/group_latency_p95_s": 4.0,
            "reward/correct_mean": 0.25,
            "weights/received": 3.0,
        },
    )
    b = report(
        10,
        6,
        **{
            "elapsed_s": 5.0,
            "cpu_s": 2.0,
            "searcher/engine_busy": 0.9,
            "searcher/reward_mean": math.nan,  # no finished group yet: left out of the mean
            "weights/load_s": 0.1,
            "searcher/group_latency_p50_s": 3.0,
            "searcher/group_latency_p95_s": 6.0,
            "reward/correct_mean": 0.75,
        },
    )
    out = combine([a, b])
    assert out["searcher/completions"] == 40 and out["searcher/version_min"] == 4
    assert "searcher/version" not in out and "searcher/oldest_version" not in out and "tokens" not in out
    assert out["searcher/engine_busy"] == pytest.approx(0.7) and out["searcher/reward_mean"] == 0.2
    assert out["weights/load_s"] == 0.3  # the slowest searcher's
    assert out["searcher/turns_per_conversation"] == pytest.approx(2.0 * 30 / 40)  # per completion, of all
    assert out["searcher/group_latency_p50_s"] == 2.0 and out["searcher/group_latency_p95_s"] == 6.0
    assert out["reward/correct_mean"] == 0.5 and out["weights/received"] == 3.0  # only a reported
    assert out["searcher/completions_per_s"] == 4.0 and out["searcher/tokens_per_s"] == 40.0  # over the longest
    assert out["searcher/cpu_per_completion_s"] == pytest.approx(8.0 / 40)  # every searcher's CPU seconds
    assert out["searcher/active_s_per_completion"] == pytest.approx((10.0 - 4.0 + 5.0) / 40)  # not paused
    assert "searcher/in_flight" not in out  # no streaming searcher: not a zero
    assert combine([]) == {}


def test_a_counter_a_searcher_left_out_is_an_error_not_a_zero():
    broken = report(5, 1, elapsed_s=1.0)
    del broken["searcher/dropped_groups"]
    with pytest.raises(KeyError, match="searcher/dropped_groups"):
        combine([broken])


def test_a_restarted_searcher_carries_its_cumulative_counts_and_loses_what_was_in_flight():
    last = report(
        12, 3, elapsed_s=7.0, **{"searcher/in_flight": 4.0, "searcher/lost_in_flight": 1.0, "weights/received": 2.0}
    )
    carried = carried_counts(last)
    assert carried["searcher/completions"] == 12 and carried["tokens"] == 120 and carried["elapsed_s"] == 7.0
    assert carried["weights/received"] == 2.0 and carried["searcher/lost_in_flight"] == 5.0
    assert "searcher/version" not in carried and "searcher/engine_busy" not in carried  # not counts
