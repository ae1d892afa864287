"""A run that survives: a searcher process killed mid-run comes back (that a killed `tba train`
leaves no Ray process behind is tests/test_prompt_accounting.py's). Each run is a `tba train`
subprocess in its own session, so a test looks only at the processes of its own run (other runs on
the machine are never touched)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import SMALL_DEMO_ARGS, stored_rollouts
from tests.helpers.processes import session_processes

from tba.metrics import read_metrics

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

SMALL = ["--runtime.type=ray", *SMALL_DEMO_ARGS, "--logging.progress=false"]


def start_run(tmp_path: Path, cache: Path, name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tba",
            "train",
            *SMALL,
            f"--model.cache_dir={cache}",
            f"--run.output_dir={tmp_path}",
            f"--run.name={name}",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TERM": "dumb"},
        start_new_session=True,  # its own session and process group: its processes are findable
    )


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout: float = 150) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and sum(1 for r in read_metrics(metrics) if "train/loss" in r) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"training did not reach step {steps}; stderr:\n{proc.communicate()[1][-3000:]}")


def searcher_pids(sid: int) -> set[int]:
    return {pid for pid, cmd in session_processes(sid).items() if cmd.startswith("ray::SearcherWorker")}


def run_with_a_killed_searcher(tmp_path: Path, demo_cache: Path) -> int:
    """A run whose searcher is killed mid-run restarts it and completes; its session's id.

    The replay bound (trainer.max_replay_ratio=1) keeps the trainer from finishing on what the
    searcher delivered before it died: the run must outlast the restart (the kill comes within a
    second of step 2; each step needs a batch of its own, and the searcher, sharing the cores, runs
    a few batches ahead at most: on a 2-core Xeon the trainer waited for the restart after step 4).
    A streaming searcher, killed with prompts in flight: the restart (the actor and its run loop,
    the same for both kinds of searcher), the count of what died with it, and weights loaded into
    the stream in flight."""
    steps = 20
    proc = start_run(
        tmp_path, demo_cache, "s", f"--trainer.steps={steps}", f"--eval.every={steps}", "--trainer.max_replay_ratio=1",
        "--generation.stream=true",
    )  # fmt: skip
    try:
        wait_for_steps(proc, tmp_path / "s" / "metrics.jsonl", 2)
        (victim,) = searcher_pids(proc.pid)
        os.kill(victim, signal.SIGKILL)
        successors: set[int] = set()
        while proc.poll() is None:  # a new searcher process replaces the killed one
            successors |= searcher_pids(proc.pid) - {victim}
            time.sleep(0.2)
        stderr = proc.communicate()[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert successors, "no searcher process replaced the killed one"
    assert "searcher 0 died" in stderr and "restarting it" in stderr
    records = read_metrics(tmp_path / "s" / "metrics.jsonl")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # no step lost
    rollouts = stored_rollouts(tmp_path / "s", steps)
    assert max(r.policy_version for r in rollouts) > 0  # the stream took new weights in flight
    # the lag bound (4 x trainer.sync_interval), counted from the oldest version of a completion
    assert all(r.arrival_step - r.policy_version <= 4 for r in rollouts)
    assert train[-1]["searcher/restarts"] == 1 and train[0]["searcher/restarts"] == 0
    assert "searcher 0 died" in (tmp_path / "s" / "errors.log").read_text()
    # every prompt taken: sent, dropped, in flight at the end, or lost with the killed process
    last = train[-1]
    assert last["searcher/lost_in_flight"] > 0
    assert last["searcher/prompts_taken"] == (
        last["searcher/groups_sent"]
        + last["searcher/dropped_groups"]
        + last["searcher/in_flight"]
        + last["searcher/lost_in_flight"]
    )
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(train, train[1:], strict=False)]
    longest = train[-1]["trainer/longest_pause_s"]
    back = [line for line in stderr.splitlines() if "is back after" in line]
    print(
        f"\nsearcher restart: longest trainer pause {longest:.3f} s (widest gap between logged steps "
        f"{max(gaps):.3f} s, after step {gaps.index(max(gaps)) + 1} of {steps}); "
        f"{back[0].strip() if back else 'not back before the end'}"
    )
    # the trainer waited for data while its only searcher restarted: counted as waiting, not as a pause
    assert longest < 5.0, "a pause of the trainer beyond its wait for data"
    assert train[-1]["trainer/wait_total_s"] > 0
    return proc.pid


def test_a_run_survives_a_killed_searcher_and_leaves_nothing_behind(tmp_path, demo_cache):
    """(A SIGKILL of ``tba train`` itself, whose Ray processes the watchdog stops, is
    tests/test_prompt_accounting.py's, before it resumes the run.)"""
    run = run_with_a_killed_searcher(tmp_path, demo_cache)
    assert not session_processes(run), "a finished run leaves nothing behind"
