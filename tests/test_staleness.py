"""Controlled staleness in the sync runtime: ``buffer.fresh_only`` (train on exactly the groups
just generated: lag 0 at k = 1) and ``runtime.extra_lag`` (the searcher samples with the weights
published D steps before the newest)."""

from __future__ import annotations

import random

import pytest
import torch
from tests.conftest import SMALL_DEMO_ARGS

from tba.buffer import BufferTooSmall, fresh_batch
from tba.config import ConfigError, load_config
from tba.metrics import read_metrics
from tba.runtime.sync_loop import run_sync
from tba.types import RolloutGroup
from tba.weights import DelayedWeights, LocalWeightStore, publications_to_keep

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

SYNC = ["--runtime.type=sync", *SMALL_DEMO_ARGS, "--logging.progress=false", "--run.threads=1"]


def group(pid: str, completions: list[list[int]], version: int = 3) -> RolloutGroup:
    n = len(completions)
    return RolloutGroup(
        prompt_id=pid,
        prompt_ids=[1, 2],
        completions=completions,
        rewards=[float(i) for i in range(n)],
        ref_logps=[-1.0] * n,
        policy_version=version,
    )


def test_fresh_batch_is_the_groups_as_sampled():
    groups = [group("a", [[5], [5], [6]]), group("b", [[7], [8]]), group("c", [])]
    batch = fresh_batch(groups, group_size=3, step=9, rng=random.Random(0))
    assert batch.num_groups == 2 and batch.group_size == 3  # the empty group is left out
    a, b = batch.rollouts[:3], batch.rollouts[3:]
    assert [r.completion for r in a] == [(5,), (5,), (6,)]  # a duplicate counts twice: no dedup
    assert [r.reward for r in a] == [0.0, 1.0, 2.0]
    assert [r.completion for r in b[:2]] == [(7,), (8,)] and b[2].completion in {(7,), (8,)}
    assert all(r.arrival_step == 9 and r.policy_version == 3 for r in batch.rollouts)
    assert batch.stats["buffer/repeat_fraction"] == pytest.approx(1 / 6)
    more = fresh_batch([group("a", [[1], [2], [3], [4]])], group_size=2, step=0, rng=random.Random(0))
    assert [r.completion for r in more.rollouts] == [(1,), (2,)]
    with pytest.raises(BufferTooSmall, match="nothing to train on"):
        fresh_batch([group("a", [])], group_size=2, step=0, rng=random.Random(0))


def test_delayed_weights_serve_the_publication_d_versions_back():
    store = LocalWeightStore(keep=publications_to_keep(3, 1))
    seen = DelayedWeights(store, 3)
    store.publish({"w": torch.zeros(1)}, 0)
    assert seen.fetch(newer_than=-1)[0] == 0  # nothing 3 versions old yet: the oldest kept
    for v in range(1, 11):
        store.publish({"w": torch.full((1,), float(v))}, v)
        version, state = seen.fetch(newer_than=-1)
        assert version == max(0, v - 3) and state["w"].item() == version
    assert seen.fetch(newer_than=7) is None and store.visible_version == 10
    # publications every k = 2 versions: the newest at least D = 3 versions old
    store = LocalWeightStore(keep=publications_to_keep(3, 2))
    assert publications_to_keep(3, 2) == 3
    for v in range(0, 12, 2):
        store.publish({"w": torch.zeros(1)}, v)
    assert store.fetch_delayed(-1, 3)[0] == 6  # newest 10, cutoff 7: 8 is too new, 6 is kept


def staleness_run(tmp_path, demo_cache, name: str, *args: str) -> list[dict]:
    cfg = load_config(
        None,
        [
            *SYNC,
            "--buffer.fresh_only=true",
            "--eval.every=100",
            "--eval.limit=4",
            f"--model.cache_dir={demo_cache}",
            f"--run.output_dir={tmp_path}",
            f"--run.name={name}",
            *args,
        ],
    )
    run_dir, _ = run_sync(cfg)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_fresh_only_trains_on_policy_at_k1(tmp_path, demo_cache):
    train = staleness_run(tmp_path, demo_cache, "fresh", "--trainer.steps=6")
    assert [r["step"] for r in train] == list(range(1, 7))
    assert all(r["train/lag_max"] == 0 and r["train/lag_mean"] == 0 and r["train/lag_fresh"] == 0 for r in train)
    assert all(r["buffer/size"] == 0 for r in train)  # nothing replayed, nothing stored
    assert all(r["searcher/version"] == r["step"] - 1 for r in train)


def test_extra_lag_makes_the_searcher_exactly_d_versions_behind(tmp_path, demo_cache):
    d = 3
    train = staleness_run(tmp_path, demo_cache, "lag", "--trainer.steps=8", f"--runtime.extra_lag={d}")
    for r in train:
        trained = r["step"] - 1  # the version of the weights that step trained
        assert r["searcher/version"] == max(0, trained - d)
        assert r["train/lag_max"] == r["train/lag_mean"] == min(trained, d)
    assert [r["train/lag_max"] for r in train] == [0, 1, 2, 3, 3, 3, 3, 3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runtime.type=ray", "--buffer.fresh_only=true"], "set runtime.type=sync"),
        (["--runtime.type=ray", "--runtime.extra_lag=4"], "set runtime.type=sync"),
        (["--eval.async=true", "--runtime.extra_lag=4"], "and drop eval.async"),  # auto can take neither runtime
        (["--runtime.type=sync", "--buffer.fresh_only=true", "--generation.prompts_per_batch=4"], "must equal"),
        (
            ["--runtime.type=sync", "--buffer.fresh_only=true", "--generation.samples_per_prompt=16"],
            "samples_per_prompt",
        ),
        (["--runtime.type=sync", "--runtime.extra_lag=2", "--run.resume=true", "--run.name=x"], "start the run afresh"),
    ],
)
def test_staleness_settings_that_cannot_work_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, args)


def test_a_step_whose_groups_were_all_dropped_is_skipped_not_a_crash(tmp_path, demo_cache, monkeypatch):
    """A policy that only answers with the end token makes the searcher drop every group of a
    step (empty completions are skipped): with ``fresh_only`` there is nothing to train on. The
    step is counted and skipped, the version, schedule and publications advance as after a step,
    and the run goes on to its last step."""
    plain = staleness_run(tmp_path, demo_cache, "plain", "--trainer.steps=6")
    from tba.searcher import Searcher

    step, calls = Searcher.step, []

    def drop_second_and_third(self):
        groups = step(self)
        calls.append(len(groups))
        return [] if len(calls) in (2, 3) else groups

    monkeypatch.setattr(Searcher, "step", drop_second_and_third)
    cfg = load_config(
        None,
        [
            *SYNC,
            "--buffer.fresh_only=true",
            "--eval.every=100",
            "--eval.limit=4",
            "--trainer.steps=6",
            f"--model.cache_dir={demo_cache}",
            f"--run.output_dir={tmp_path}",
            "--run.name=empty",
        ],
    )
    run_dir, _ = run_sync(cfg)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, 7)) and all(n > 0 for n in calls)
    assert [r["train/empty_steps"] for r in records] == [0, 1, 2, 2, 2, 2]
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 2, 2, 2, 2]
    assert ["train/loss" in r for r in records] == [True, False, False, True, True, True]
    assert [r["searcher/version"] for r in records] == [0, 1, 2, 3, 4, 5]  # published every step all the same
    assert [r["train/lr"] for r in records] == pytest.approx([r["train/lr"] for r in plain])  # the schedule too
    assert records[0]["train/loss"] == pytest.approx(plain[0]["train/loss"])  # the same run until the drop
