"""What a run shows and what its metric names mean.

- :class:`tba.console.RunDisplay` with an injected clock: plain lines off a terminal every
  ``line_every_s`` seconds and at each evaluation, with figures computed from counts and the clock;
  nothing when quiet; a live view on a terminal.
- ``train/lag_fresh`` on a hand-built batch, and in a real tiny sync run (0 at sync_interval 1, v mod k
  at sync_interval k).
- The manual's metric table (docs/evaluation.md) covers every metric name the code can write (found by a regex over the
  sources) and every key of a real run's ``metrics.jsonl``, so it cannot go stale.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from tba.config import LoggingConfig, load_config
from tba.console import RunDisplay, format_duration
from tba.eval_metrics import sampled_metrics
from tba.metrics import read_metrics
from tba.trainer import group_metrics, lag_metrics
from tba.types import Batch, Rollout

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tba"


class Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_metrics(step: int) -> dict[str, float]:
    """What a step reports: 10 completions per step, searchers one version behind."""
    return {
        "searcher/reward_mean": 0.3,
        "train/lag_mean": 1.0,
        "train/lag_fresh": 0.5,
        "searcher/completions": 10.0 * step,
        "searcher/version": float(step - 1),
    }


def run_display(display: RunDisplay, clock: Clock, steps: int, eval_at: set[int]) -> None:
    """Step 0 evaluates; then one step per second of the clock, evaluating at ``eval_at``."""
    with display:
        display.update(0, {"eval/accuracy": 0.25})
        for step in range(1, steps + 1):
            clock.now = float(step)
            record = step_metrics(step)
            if step in eval_at:
                record["eval/accuracy"] = 0.3
            display.update(step, record)


def test_plain_lines_come_every_line_every_s_and_at_evaluations():
    clock, out = Clock(), io.StringIO()
    display = RunDisplay(600, console=Console(file=out, width=80), line_every_s=30.0, clock=clock)
    run_display(display, clock, steps=100, eval_at={50})
    lines = out.getvalue().splitlines()
    # step 0 and 50 evaluate; 30 and 80 are 30 s after the line before; 100 is only 20 s after 80
    assert [line.split()[1] for line in lines] == ["0/600", "30/600", "50/600", "80/600"]
    assert lines[0] == "step 0/600 (0%)  eval 25.0%"
    # 10 completions a second since they were first counted (step 1, t=1): (300 - 10) / (30 - 1);
    # 30 steps in 30 s leave 570 steps: 9m30s; one line, however wide the console
    assert lines[1] == (
        "step 30/600 (5%)  reward 0.30  eval 25.0%  lag 1.0 (fresh 0.5)  10.0 compl/s  eta 9m30s  searchers v29"
    )
    assert lines[2].startswith("step 50/600 (8%)  reward 0.30  eval 30.0%")
    assert "eta 9m10s" in lines[2]  # 550 steps left at 1 s a step


def test_searchers_and_restarts_of_the_ray_runtime_show():
    clock, out = Clock(), io.StringIO()
    display = RunDisplay(10, console=Console(file=out, width=80), eval_key="eval/reward", clock=clock)
    with display:
        display.update(0, {})  # a resumed run's start: no evaluation, no line
        clock.now = 4.0
        display.update(2, {"eval/reward": 0.123456, "searcher/restarts": 1.0, "searcher/version": 7.0}, [2, None])
    assert out.getvalue().splitlines() == [
        "step 2/10 (20%)  eval 0.123  eta 16s  searchers v2,restarting  restarts 1"
    ]  # eval/reward is not a rate: no percent; 2 steps in 4 s leave 8 steps


@pytest.mark.parametrize("settings", [{"quiet": True}, {"progress": False}, {"quiet": True, "progress": True}])
def test_quiet_or_no_progress_prints_nothing(settings):
    clock, out = Clock(), io.StringIO()
    display = RunDisplay.from_config(
        LoggingConfig(**settings), 100, "eval/accuracy", console=Console(file=out), clock=clock
    )
    run_display(display, clock, steps=100, eval_at={50, 100})
    assert out.getvalue() == ""


def test_the_terminal_view_renders_the_figures():
    clock, out = Clock(), io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    display = RunDisplay(600, console=console, clock=clock)
    assert display.live
    run_display(display, clock, steps=30, eval_at=set())
    text = out.getvalue()
    assert "30/600" in text
    assert "reward 0.30  eval 25.0%  lag 1.0 (fresh 0.5)  10.0 compl/s  eta 9m30s  searchers v29" in text
    assert "step 30/600" not in text  # the live view, not plain lines


def test_durations_read_short():
    assert [format_duration(s) for s in (0, 45.4, 190, 3599, 7500)] == ["0s", "45s", "3m10s", "59m59s", "2h05m"]


def rollout(policy_version: int, arrival_step: int) -> Rollout:
    return Rollout("p", (1,), 0.0, 0.0, policy_version, arrival_step)


def test_lag_fresh_counts_only_what_arrived_since_the_previous_step():
    # the step trains version 10: two replayed rollouts (arrived at steps 4 and 9) and three that
    # arrived at step 10, from searchers holding versions 9, 8 and 10
    rollouts = [rollout(3, 4), rollout(8, 9), rollout(9, 10), rollout(8, 10), rollout(10, 10)]
    batch = Batch(prompt_ids=[[0]], rollouts=rollouts, group_size=5)
    lags = lag_metrics(batch, version=10)
    assert lags == {"train/lag_mean": (7 + 2 + 1 + 2 + 0) / 5, "train/lag_max": 7.0, "train/lag_fresh": 1.0}
    replayed_only = Batch(prompt_ids=[[0]], rollouts=rollouts[:2], group_size=2)
    assert "train/lag_fresh" not in lag_metrics(replayed_only, version=10)


def test_group_metrics_count_flat_mixed_and_unfinished():
    def r(reward, version, finished=True):
        return Rollout("p", (1,), reward, 0.0, version, version, finished=finished)

    # three groups of two: rewards differ (versions 3 and 4, one unfinished); equal (version 5);
    # equal (versions 5 and 6, both unfinished)
    rollouts = [r(1.0, 3), r(0.0, 4, False), r(0.5, 5), r(0.5, 5), r(0.0, 5, False), r(0.0, 6, False)]
    batch = Batch(prompt_ids=[[0], [1], [2]], rollouts=rollouts, group_size=2)
    assert group_metrics(batch) == {
        "train/flat_groups": 2 / 3,
        "train/mixed_groups": 2 / 3,
        "train/unfinished": 3 / 6,
    }


# ---------------------------------------------------------------- metric names and the manual

NAME = re.compile(r"f?\"((?:train|trainer|searcher|buffer|eval|reward|weights|prompts)/[^\"\n]*)\"")


def task_metrics() -> list[str]:
    """``eval/<eval_metric>`` of every task (the base class's default and each override)."""
    found = re.findall(r"eval_metric(?:: str)? = \"(\w+)\"", "".join(_read(p) for p in (SRC / "tasks").glob("*.py")))
    assert "accuracy" in found and "win_rate" in found, found
    return [f"eval/{m}" for m in found]


def sampled_metric_names() -> list[str]:
    """The sampled evaluation's names (``eval/pass@k``, ``eval/maj@k``), from the function that makes them."""
    names = sampled_metrics([(["1", "2"], [1.0, 0.0])], [1, 2])
    return sorted({"eval/" + re.sub(r"@\d+$", "@k", n) for n in names if n != "mean_score"})


def objective_metrics() -> list[str]:
    """``train/<key>`` of every key an objective returns (``log_z_mean`` is logged as ``train/log_z``)."""
    text = "".join(_read(p) for p in sorted((SRC / "objectives").glob("*.py")))
    keys = set(re.findall(r"\"(\w+)\": ", text)) | set(re.findall(r"metrics\[\"(\w+)\"\] = ", text))
    assert {"log_z_mean", "kl", "clip_fraction"} <= keys, keys
    return sorted(f"train/{'log_z' if k == 'log_z_mean' else k}" for k in keys)


# f-string metric names in the sources, and the README rows that stand for each
FAMILIES: dict[str, Callable[[], list[str]]] = {
    "eval/{c.task.eval_metric}": task_metrics,
    "eval/{task.eval_metric}": task_metrics,
    "eval/{name}": sampled_metric_names,
    "eval/{task.eval_metric}/{group}": lambda: ["eval/reward/<dataset>"],
    "reward/{name}_mean": lambda: ["reward/<name>_mean"],
    "reward/{key}_mean": lambda: ["reward/<name>_mean"],  # an agent's metrics (a verifiers rubric's functions)
    "train/{'log_z' if key == 'log_z_mean' else key}": objective_metrics,
}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def source_metric_names() -> set[str]:
    """Every metric name the code can write, f-string families expanded to their rows in the manual."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for name in NAME.findall(_read(path)):
            if "{" in name:
                assert name in FAMILIES, f"{path}: metric family {name!r} has no row in the manual; add it to FAMILIES"
                names.update(FAMILIES[name]())
            elif re.fullmatch(r"[a-z]+/[\w@]*\w", name):  # not a bare prefix such as "eval/pass@"
                names.add(name)
    return names


def documented() -> set[str]:
    """The names in the manual's metrics section (``docs/evaluation.md``, ``## Metrics``: the first
    column of its tables)."""
    text = _read(ROOT / "docs" / "evaluation.md")
    section = text.split("\n## Metrics", 1)[1].split("\n## ", 1)[0].split("\n# ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def row_for(key: str) -> str:
    """The manual's row that documents a metrics.jsonl key: ``eval/pass@4`` → ``eval/pass@k``."""
    key = re.sub(r"^(eval/(?:pass|maj))@\d+$", r"\1@k", key)
    return re.sub(r"^reward/.+_mean$", "reward/<name>_mean", key)


def test_every_metric_name_in_the_sources_has_a_readme_row():
    names = source_metric_names()
    assert {"train/lag_fresh", "eval/pass@k", "searcher/restarts", "eval/win_rate", "train/log_z"} <= names
    missing = sorted(names - documented())
    assert not missing, f"add these to the metric table in docs/evaluation.md (## Metrics): {missing}"
    stale = sorted(documented() - names)
    assert not stale, f"the manual's metric table lists names the code no longer writes: {stale}"


@pytest.mark.parametrize("sync_interval", [1, 2])
def test_a_real_run_writes_documented_metrics_and_lag_fresh_follows_the_sync_interval(
    sync_interval, tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    from tba.runtime import report
    from tba.runtime import sync_loop as sync

    monkeypatch.setattr(report, "plot_run", lambda *args: None)  # plots are not under test: 2 s saved

    cfg = load_config(
        None,
        [
            "--runtime.type=sync",
            f"--model.policy={tiny_checkpoint}",
            "--task.digits=1",
            "--task.eval_size=4",
            "--generation.prompts_per_batch=4",
            "--generation.group_size=2",
            "--generation.max_new_tokens=3",
            "--trainer.batch_prompts=4",
            "--trainer.steps=4",
            f"--trainer.sync_interval={sync_interval}",
            "--eval.every=2",
            "--eval.samples=2",
            "--eval.pass_k=[1,2]",
            "--logging.quiet=true",
            f"--run.output_dir={tmp_path}",
            "--run.name=r",
        ],
    )
    out = io.StringIO()
    run_dir, _ = sync.run_sync(cfg, console=Console(file=out, width=200))
    records = read_metrics(run_dir / "metrics.jsonl")
    keys = {k for r in records for k in r} - {"step", "time_s"}
    assert {"eval/pass@2", "train/lag_fresh", "searcher/reward_mean"} <= keys
    missing = sorted({row_for(k) for k in keys} - documented())
    assert not missing, f"add these to the metric table in docs/evaluation.md (## Metrics): {missing}"
    # every step trains on data generated right before it, by weights published 0..k-1 steps ago
    fresh = [r["train/lag_fresh"] for r in records if "train/loss" in r]
    assert fresh == [float(step % sync_interval) for step in range(4)]
    # quiet: the summary only, no progress lines and no messages
    assert "run directory" not in out.getvalue() and "sampled reward" in out.getvalue()
    assert capsys.readouterr().err == ""
