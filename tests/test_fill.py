"""The initial fill is watched (tba.runtime.fill): a run whose searchers deliver nothing the buffer
can sample says what they delivered and stops, by counts of prompts, never by a clock; and a
policy whose context cannot hold the prompts and their completions is refused before the run
starts (tba.runtime.preflight.check_context). The end-to-end runs of both runtimes that end in the
fill's line are in tests/test_task_training.py."""

from __future__ import annotations

import pytest

from tba.buffer import ReplayBuffer
from tba.config import ConfigError, load_config
from tba.runtime.fill import NOTICE_BATCHES, Fill, NothingToTrain
from tba.runtime.sync_loop import run_sync
from tba.types import RolloutGroup

EMPTY = {"searcher/completions": 32.0, "searcher/empty_completions": 32.0, "searcher/dropped_groups": 8.0}


def group(prompt: str, completions: list[list[int]]) -> RolloutGroup:
    k = len(completions)
    return RolloutGroup(prompt, [1, 2], completions, [1.0] * k, [0.0] * k, policy_version=0)


def make_fill(patience: int | None = 8, batch_prompts: int = 2, min_groups: int = 2, per_batch: int = 8):
    said: list[str] = []
    buffer = ReplayBuffer(capacity=1000, min_completions=2, seed=0)
    return Fill(buffer, batch_prompts, min_groups, per_batch, patience, said.append), buffer, said


def test_a_fill_of_dropped_groups_says_once_what_was_delivered_then_stops_with_that_line():
    fill, _, said = make_fill(patience=8)
    for batch in range(1, 8):  # 8 prompts a batch, all dropped: no group reaches the trainer
        fill.observe(0, 8, EMPTY)
        assert len(said) == (1 if batch >= NOTICE_BATCHES else 0)
    assert "the run stops after 8 batches' worth of prompts" in said[0]
    with pytest.raises(NothingToTrain) as err:
        fill.observe(0, 8, EMPTY)
    line = str(err.value)
    assert line.startswith("initial fill: 64 prompts drawn, nothing to train on yet")
    assert "32 completions, of which 32 empty (only end tokens)" in line
    assert "0 groups reached the trainer (8 dropped with fewer than two usable completions)" in line
    assert "buffer.fill_patience" in line and "generation.max_new_tokens" in line


def test_duplicates_that_never_reach_min_completions_are_named():
    fill, buffer, _ = make_fill(patience=2, per_batch=2)  # stops after 4 prompts without progress
    same = [[5, 9], [5, 9]]  # two copies of one completion: one distinct, below min_completions=2

    def deliver():
        groups = [group("a", same), group("b", same)]
        for g in groups:
            buffer.add(g, step=0)
        fill.observe(len(groups), 0, {"searcher/completions": 4.0})

    deliver()
    with pytest.raises(NothingToTrain) as err:
        deliver()
    line = str(err.value)
    assert "4 groups reached the trainer" in line
    assert "the buffer holds 2 prompts, 0 with buffer.min_completions=2 distinct completions (6 duplicates)" in line


def test_progress_restarts_the_count_and_a_ready_buffer_ends_the_fill():
    fill, buffer, said = make_fill(patience=2, per_batch=4, min_groups=3)
    fill.observe(0, 7, EMPTY)  # 7 of the 8 prompts the patience allows
    buffer.add(group("a", [[3], [4]]), step=0)  # one sampleable prompt: progress
    fill.observe(1, 3, EMPTY)
    assert fill.stalled == 0 and not fill.ready()
    fill.observe(0, 7, EMPTY)  # 7 more without progress: still under the patience
    for prompt in ("b", "c"):
        buffer.add(group(prompt, [[3], [4]]), step=0)
    fill.observe(2, 0, EMPTY)
    assert fill.ready() and not said


def test_no_patience_waits_and_says_so():
    fill, _, said = make_fill(patience=None, per_batch=1)
    for _ in range(1000):
        fill.observe(0, 1, EMPTY)
    assert len(said) == 1 and "never for this (buffer.fill_patience=null)" in said[0]


def test_prompts_and_completions_longer_than_the_context_are_refused_before_the_run(tmp_path):
    # the demo model's context is 64 positions; its prompts are about 10 tokens
    cfg = load_config(None, ["--runtime.type=sync", "--generation.max_new_tokens=60", f"--run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        run_sync(cfg)
    message = str(err.value)
    assert "plus generation.max_new_tokens=60 need" in message and "the policy's context is 64" in message
    assert "lower generation.max_new_tokens" in message
    assert not any(tmp_path.iterdir())  # refused before the run directory exists
