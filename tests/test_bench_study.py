"""The benchmarks' study runner (``benchmarks/harness/study.py``): arms expanded over seeds and
repeats in each order, rows saved after every trial and read back so that a second invocation runs
only what is missing, and the table's means and standard deviations. The trials here are a function
the test passes in: no ``tba train``, no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # the scripts import the harness as a top-level package
    sys.path.append(str(BENCHMARKS))

from harness.study import SEEDS, Arm, Column, Results, Trial, run_study, table, trials  # noqa: E402


def names(ts: list[Trial]) -> list[str]:
    return [t.name for t in ts]


def test_arms_expand_over_seeds_and_repeats_in_each_order():
    a, b = Arm("a", "sync", seeds=[0, 1]), Arm("b", "ray", seeds=[0, 1])
    assert names(trials([a, b], "arm")) == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]
    assert names(trials([a, b], "seed")) == ["a-seed0", "b-seed0", "a-seed1", "b-seed1"]
    four = [Arm("a", seeds=range(4)), Arm("b", seeds=range(4))]
    assert [(t.arm.name, t.seed) for t in trials(four, "abba")] == [
        ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)
    ]  # fmt: skip
    twice = Arm("c", seeds=[5], repeats=2)
    assert names(trials([twice], "abba")) == ["c-seed5-r0", "c-seed5-r1"]
    assert trials([twice])[1].fields == {"arm": "c", "seed": 5, "repeat": 1}
    with pytest.raises(ValueError, match="unknown order"):
        trials([a], "random")


def test_a_trial_names_its_runtime_overrides_and_seed():
    arm = Arm("x", "ray", ["--trainer.steps=3"], seeds=[7], fields={"setting": "demo", "arm": "x"})
    (trial,) = trials([arm])
    assert trial.args == ["--runtime.type=ray", "--trainer.steps=3", "--run.seed=7"]
    assert trial.fields == {"setting": "demo", "arm": "x", "seed": 7}
    (plain,) = trials([Arm("y")])  # the config's runtime and seed: neither is named
    assert plain.args == [] and plain.name == "y" and plain.fields == {"arm": "y"}


def fake(calls: list[str], fail: set[str] = frozenset()):
    """A trial's row without a run: its gain is the seed over ten, plus one for arm b."""

    def run(trial: Trial) -> dict:
        calls.append(trial.name)
        if trial.name in fail:
            return {"error": "boom\nsecond line"}
        return {"gain": trial.seed / 10 + (1.0 if trial.arm.name == "b" else 0.0), "wall_s": 10.0 * (trial.seed + 1)}

    return run


def test_rows_are_saved_after_each_trial_and_a_second_invocation_runs_only_what_is_missing(tmp_path):
    path = tmp_path / "results.json"
    arms = [Arm("a", seeds=[0, 1]), Arm("b", seeds=[0, 1])]
    calls: list[str] = []
    results = Results(path, ("arm", "seed"), head={"environment": {"cpu": "test"}})
    rows = run_study(arms, fake(calls, fail={"b-seed1"}), results, echo=None)
    assert calls == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]
    saved = json.loads(path.read_text())
    assert saved["environment"] == {"cpu": "test"}
    assert [(r["arm"], r["seed"]) for r in saved["runs"]] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert saved["runs"] == rows and rows[0] == {"gain": 0.0, "wall_s": 10.0, "arm": "a", "seed": 0}

    calls.clear()  # the same study again: only the failed trial and the new seed run
    more = [Arm("a", seeds=[0, 1, 2]), Arm("b", seeds=[0, 1])]
    rows = run_study(more, fake(calls), Results(path, ("arm", "seed")), echo=None)
    assert calls == ["a-seed2", "b-seed1"]
    assert sorted((r["arm"], r["seed"]) for r in rows) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert not any("error" in r for r in json.loads(path.read_text())["runs"])

    calls.clear()  # without resume every trial runs again and replaces its row
    run_study([Arm("a", seeds=[1])], fake(calls), Results(path, ("arm", "seed")), resume=False, echo=None)
    assert calls == ["a-seed1"] and len(json.loads(path.read_text())["runs"]) == 5

    calls.clear()  # fresh: the rows kept are forgotten
    rows = run_study([Arm("b", seeds=[0])], fake(calls), Results(path, ("arm", "seed"), fresh=True), echo=None)
    assert calls == ["b-seed0"] and [(r["arm"], r["seed"]) for r in json.loads(path.read_text())["runs"]] == [("b", 0)]


def test_a_save_keeps_another_invocations_rows_and_the_files_other_sections(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"other": {"runs": [{"name": "x"}]}, "mine": {"note": 1}}))
    mine = Results(path, ("name",), section=("mine", "runs"), head={"environment": "here"})
    meanwhile = Results(path, ("name",), section=("mine", "runs"))
    run_study([Arm("p", fields={"name": "p"})], lambda t: {"v": 1}, mine, echo=None)
    run_study([Arm("q", fields={"name": "q"})], lambda t: {"v": 2}, meanwhile, echo=None)
    data = json.loads(path.read_text())
    assert data["other"] == {"runs": [{"name": "x"}]}
    assert data["mine"]["note"] == 1 and data["mine"]["environment"] == "here"
    assert [r["name"] for r in data["mine"]["runs"]] == ["q", "p"]
    listed = Results(tmp_path / "list.json", ("arm", "seed"), section=())
    run_study([Arm("a", seeds=[3])], lambda t: {"v": 3}, listed, echo=None)
    assert json.loads((tmp_path / "list.json").read_text()) == [{"v": 3, "arm": "a", "seed": 3}]


def test_the_table_gives_each_arms_mean_and_standard_deviation():
    rows = run_study([Arm("a", seeds=[0, 1, 2]), Arm("b", seeds=[4])], fake([]), echo=None)
    columns = [
        Column("arm", "arm", "first", ""),
        SEEDS,
        Column("gain", "gain"),
        Column("gain, always ±", "gain", "std", ".2f"),
        Column("wall", "wall_s", "mean", ".1f", suffix=" s", align="r"),
        Column("each", "wall_s", "each", ".0f", sep="/"),
        Column("missing", "nothing"),
        Column("n", cell=lambda rs: str(len(rs))),
    ]
    lines = table(rows, ("arm",), columns).splitlines()
    assert lines[0] == "| arm | seeds | gain | gain, always ± | wall | each | missing | n |"
    assert lines[1] == "|---|---|---|---|---:|---|---|---|"
    # a: gains 0.0, 0.1, 0.2 (mean 0.1, sample std 0.1); walls 10, 20, 30 s (mean 20)
    assert lines[2] == "| a | 0,1,2 | 0.100 ± 0.100 | 0.10 ± 0.10 | 20.0 s | 10/20/30 | - | 3 |"
    # b: one seed claims no spread (unless asked: ± 0)
    assert lines[3] == "| b | 4 | 1.400 | 1.40 ± 0.00 | 50.0 s | 50 | - | 1 |"
    assert len(lines) == 4


def test_an_arm_with_only_failed_rows_shows_its_first_error_line():
    rows = run_study([Arm("a", seeds=[0, 1]), Arm("b", seeds=[0])], fake([], fail={"a-seed1", "b-seed0"}), echo=None)
    text = table(rows, ("arm",), [Column("arm", "arm", "first", ""), Column("gain", "gain"), Column("n", "seed")])
    assert text.splitlines()[2:] == ["| a | 0.000 | 0.000 |", "| b | boom |  |"]


def test_the_cost_pairs_hold_each_runs_prediction_to_the_other_run(tmp_path):
    """bench_cost_pairs.py: run A's parts predict run B (and B's predict A); within 15% with the
    ranking right passes, else the part that moved most between the two runs is named."""
    import bench_cost_pairs as pairs

    def write(layout, runtime, step_s, alternatives, parts, busy=1.0):
        folder = tmp_path / pairs.run_name("demo", layout)
        folder.mkdir(exist_ok=True)
        measured = {"step_s": step_s, "parts": parts, "trainer_busy": busy, "lag_mean": 1.0}
        summary = {"runtime": runtime, "measured": measured, "alternatives": alternatives}
        (folder / "summary.json").write_text(json.dumps(summary))

    def alt(bound="trainer", **steps):
        return {k: {"step_s": v, "bound": bound} for k, v in steps.items()}

    sync_parts = {"generate_s": 0.17, "train_s": 0.18, "overhead_s": 0.001, "load_s": 0.0, "publish_s": 0.0}
    ray_parts = {**sync_parts, "train_s": 0.36, "overhead_s": 0.01}  # the trainer beside a searcher: twice as slow
    write("sync", "sync", 0.35, alt(sync=0.352, ray_1=0.184), sync_parts)
    write("ray_1", "ray", 0.36, alt(sync=0.53, ray_1=0.37), ray_parts)
    rows = pairs.pair_rows(tmp_path)
    assert [(r["from"], r["predicts"]) for r in rows] == [("sync", "ray_1"), ("ray_1", "sync")]
    sync_to_ray, ray_to_sync = rows
    assert sync_to_ray["error"] == pytest.approx(0.184 / 0.36 - 1, abs=1e-3)
    # sync's parts say ray is faster (0.184 < 0.352); the runs say it is slower (0.36 > 0.35)
    assert sync_to_ray["ranking_right"] is False
    assert sync_to_ray["miss"] == "the trainer's step: 0.18 s in sync, 0.36 s in ray"
    # ray's parts say sync is slower (0.53 > 0.37): wrong as well, and 51% off
    assert ray_to_sync["error"] == pytest.approx(0.53 / 0.35 - 1, abs=1e-3) and ray_to_sync["ranking_right"] is False
    assert ray_to_sync["miss"] == "the trainer's step: 0.36 s in ray, 0.18 s in sync"
    # a prediction within 15%, ranked right, names no miss
    write("ray_2", "ray", 0.2, alt(ray_2=0.2, ray_4=0.2), ray_parts)
    (tmp_path / "demo-ray_1" / "summary.json").unlink()
    write("ray_4", "ray", 0.21, alt(ray_2=0.22, ray_4=0.19), ray_parts)
    both = {(r["from"], r["predicts"]): r for r in pairs.pair_rows(tmp_path)}
    assert both[("ray_2", "ray_4")]["miss"] is None and both[("ray_2", "ray_4")]["ranking_right"] is True
    # the lag bound set the predicted pace: it is the miss, whatever the parts did
    write("ray_2", "ray", 0.2, alt(bound="lag", ray_2=0.2, ray_4=0.3), ray_parts)
    lagged = {(r["from"], r["predicts"]): r for r in pairs.pair_rows(tmp_path)}[("ray_2", "ray_4")]
    assert lagged["miss"] == "the lag bound: it set the predicted pace; ray measured lag 1"
    # predicted trainer-bound, the parts the same, and the trainer of the run waited
    write("ray_4", "ray", 0.3, alt(ray_2=0.22, ray_4=0.3), ray_parts, busy=0.7)
    waited = {(r["from"], r["predicts"]): r for r in pairs.pair_rows(tmp_path)}[("ray_4", "ray_2")]
    assert waited["miss"] is None  # (0.22 against 0.2: within 15%)
    write("ray_2", "ray", 0.3, alt(ray_2=0.3, ray_4=0.2), ray_parts, busy=0.7)
    waited = {(r["from"], r["predicts"]): r for r in pairs.pair_rows(tmp_path)}[("ray_4", "ray_2")]
    assert waited["miss"] == "the trainer's wait: busy 0.70 in ray, where the parts say it never waits"
    # parts measured with other threads: the model scales each by the ratio, and the miss says so
    two, one = {"generate_threads": 2, "train_threads": 2}, {"generate_threads": 1, "train_threads": 1}
    write("sync", "sync", 0.35, alt(sync=0.352, ray_1=0.53), {**sync_parts, **two})
    write("ray_1", "ray", 0.36, alt(sync=0.2, ray_1=0.37), {**ray_parts, "generate_s": 0.2, **one})
    threaded = {(r["from"], r["predicts"]): r for r in pairs.pair_rows(tmp_path)}[("sync", "ray_1")]
    # the trainer's 0.18 s at two threads is the 0.36 at one that ray measured; the batch's 0.17 is not 0.2
    assert threaded["miss"] == "a searcher's batch: 0.17 s in sync, 0.2 s in ray (2 -> 1 threads: expected 0.34 s)"
