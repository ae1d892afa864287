"""Bounds on replay and staleness (``trainer.max_replay_ratio``, ``runtime.max_lag``): the gate's
arithmetic (with both off it never holds a step: ``test_both_bounds_off_never_wait``), and the ray
runtime with a searcher slowed on purpose under both bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import SMALL_DEMO_ARGS
from tests.helpers.numerics import assert_reordered_close

from tba.config import ConfigError, load_config
from tba.metrics import read_metrics
from tba.plan.auto import lag_bound
from tba.runtime.bounds import Starvation, StepGate

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def test_the_replay_bound_counts_the_window_and_the_initial_fill():
    gate = StepGate(batch_samples=10, max_replay_ratio=2.0, window=3, max_lag=None)
    assert gate.blocked(0, []) == "replay"  # nothing has arrived
    gate.add_arrivals(5)
    assert gate.replay_ratio() == 2.0 and gate.blocked(0, []) is None  # 10 trained per 5 arrived
    gate.stepped()  # step 1 trained; step 2's window: steps 1-2, arrivals since the start
    assert gate.replay_ratio() == 4.0 and gate.blocked(1, []) == "replay"
    gate.add_arrivals(5)
    assert gate.blocked(1, []) is None
    gate.stepped()
    gate.add_arrivals(5)
    assert gate.replay_ratio() == 2.0 and gate.blocked(2, []) is None  # 30 trained per 15
    gate.stepped()  # the window is full: steps 2-4, arrivals since step 2 began (at 5)
    assert gate.bases[0] == 5 and gate.replay_ratio() == 3.0 and gate.blocked(3, []) == "replay"
    gate.add_arrivals(5)
    assert gate.replay_ratio() == 2.0 and gate.blocked(3, []) is None
    assert gate.trained == 30 and gate.arrived == 20


def test_the_lag_bound_is_on_the_version_a_step_would_make():
    gate = StepGate(batch_samples=10, max_replay_ratio=None, window=3, max_lag=2)
    assert gate.blocked(3, [2, 3]) is None  # to version 4: 4 - 2 (the oldest) = 2
    assert gate.blocked(4, [2, 3]) == "lag"  # to version 5: 3 versions ahead of the oldest
    assert gate.blocked(4, [3, 4]) is None
    assert gate.blocked(9, []) is None  # no live searcher: nothing to wait for (the replay bound holds then)


def test_both_bounds_off_never_wait():
    gate = StepGate(batch_samples=10, max_replay_ratio=None, window=3, max_lag=None)
    for version in range(50):
        assert gate.blocked(version, [0]) is None
        gate.stepped()


def test_a_wait_while_every_generated_completion_is_dropped_is_said_once():
    watch = Starvation(after_s=60.0)
    watch.begin(now=100.0, arrived=512, generated=900)
    assert watch.check(159.0, 512, 5000) is None  # not long enough yet
    message = watch.check(161.0, 512, 5000)
    assert message and "waited 61 s" in message and "4100 completions" in message and "dropped every one" in message
    assert watch.check(300.0, 512, 9000) is None  # once per wait
    watch.begin(now=400.0, arrived=512, generated=9000)  # the next wait is noticed again
    assert watch.check(470.0, 512, 9100) is not None
    # a wait that data ends, or searchers that generate nothing (restarting, slow), is not this
    watch.begin(now=0.0, arrived=512, generated=900)
    assert watch.check(100.0, 576, 5000) is None
    assert watch.check(100.0, 512, 900) is None


def test_max_lag_below_the_sync_interval_is_refused_and_auto_follows_it():
    with pytest.raises(ConfigError, match=r"runtime.max_lag=2 is below trainer.sync_interval=3"):
        load_config(None, ["--runtime.max_lag=2", "--trainer.sync_interval=3"])
    cfg = load_config(None, ["--trainer.sync_interval=3"])
    assert cfg.runtime.max_lag == "auto" and lag_bound(cfg.runtime, 3) == 12
    assert lag_bound(load_config(None, ["--runtime.max_lag=null"]).runtime, 1) is None


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task" / "problems.jsonl"
SLOW_REWARD = """
import time

def slow_exact(prompts, completions, completion_ids, answer, **kwargs):
    time.sleep(0.3)  # a searcher slowed on purpose: each batch takes at least this long
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]
"""


SLOW_STEPS = 4


def slow_run(tmp_path, demo_cache, name: str, *extra: str):
    from tba.runtime.async_loop import run_ray

    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    (policy,) = [p for p in demo_cache.iterdir() if p.name.startswith("tiny-arithmetic")]
    args = [
        *SMALL_DEMO_ARGS,
        "--runtime.type=ray",
        "--logging.progress=false",
        f"--model.policy={policy}",
        "--task.name=dataset",
        f"--task.path={EXAMPLE}",
        f"--task.reward_funcs=[{tmp_path / 'slow.py'}:slow_exact]",
        "--task.answer_column=answer",
        "--task.eval_size=8",
        f"--trainer.steps={SLOW_STEPS}",
        f"--eval.every={SLOW_STEPS}",
        f"--run.output_dir={tmp_path}",
        f"--run.name={name}",
        *extra,
    ]
    args = [a for a in args if not a.startswith(("--task.digits", "--task.operators"))]
    run_dir, summary = run_ray(load_config(None, args))
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("train/loss") is not None]
    assert [r["step"] for r in train] == list(range(1, SLOW_STEPS + 1))
    return summary, train


def test_a_slow_searcher_holds_the_trainer_within_both_bounds(tmp_path, demo_cache, local_ray):
    summary, train = slow_run(tmp_path, demo_cache, "bounded", "--trainer.max_replay_ratio=1.0", "--runtime.max_lag=1")
    assert all(r["train/replay_ratio"] <= 1.0 for r in train)
    assert all(r["buffer/arrival_lag_max"] <= 1 for r in train)  # every batch arrived at most 1 step stale
    # and was trained so: the lag of newly arrived data, the staleness the objective sees
    assert all(r["train/lag_fresh"] <= 1 for r in train if "train/lag_fresh" in r)
    # over the run: SLOW_STEPS steps x 64 samples trained, at most once each on average
    assert summary["replay_ratio"] <= 1.0 and train[-1]["searcher/completions"] >= SLOW_STEPS * 64
    # the waiting is accounted for: per step, summed, and in the summary; with max_lag=1 each step
    # needs a batch begun after the previous step's weights were published (at least 0.3 s of reward),
    # so the trainer waited, however fast either side ran
    waits = [r["trainer/wait_s"] for r in train]
    assert_reordered_close(sum(waits), train[-1]["trainer/wait_total_s"], dtype=torch.float64, terms=len(waits))
    assert summary["trainer_wait_s"] == pytest.approx(train[-1]["trainer/wait_total_s"], abs=1e-3)
    assert train[-1]["trainer/wait_total_s"] > 0
