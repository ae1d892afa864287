"""The run's pace: parts measured from its steps' records, its first steps' prediction held to the
rest, and what its parts predict for the other layouts (tba.runtime.pace), on records written
here with known seconds."""

from __future__ import annotations

import pytest

from tba.machine import usable_cores
from tba.plan.cost import Layout, StepParts, predict
from tba.runtime.pace import PaceMeter, early_steps, pace_line


class Clock:
    """A step clock whose active and paused seconds the test sets."""

    def __init__(self) -> None:
        self.active = self.paused_s = self.cpu = 0.0

    def active_s(self) -> float:
        return self.active

    def active_cpu_s(self) -> float:
        return self.cpu


def sync_record(generate=0.2, train=0.1, publish=0.01, load=0.005, lag=0.0) -> dict:
    return {
        "searcher/generate_s": generate,
        "train/step_s": train,
        "train/publish_s": publish,
        "weights/load_s": load,
        "train/lag_fresh": lag,
        "trainer/wait_s": 0.0,
    }


def run(meter: PaceMeter, clock: Clock, steps: range, record: dict, active: float, pause: float = 0.0, cpu=0.0) -> None:
    for step in steps:
        clock.active += active
        clock.cpu += cpu  # the trainer process's CPU seconds
        meter.after_step(step, dict(record))
        clock.paused_s += pause  # the observers after the meter pause the loop


def test_the_first_steps_predict_the_rest_and_the_error_is_measured_over_predicted():
    layout = Layout("sync", 64, 64)
    clock, said = Clock(), []
    meter = PaceMeter(layout, clock, steps=60, log=said.append)
    assert meter.early == 6
    meter.announce()
    assert said.pop() == "pace: steps 2-7 will predict the rest (tba train --parts-from=RUN predicts before a run)"
    # steps 1-7 at 0.33 s: 0.2 generation (a 0.005 load in it), 0.1 optimizer, 0.01 publication, 0.02 the rest;
    # 0.5 CPU seconds a step, 0.3 of them the generation's
    run(meter, clock, range(1, 8), {**sync_record(), "searcher/generate_cpu_s": 0.3}, 0.33, pause=0.5, cpu=0.5)
    assert meter.prediction is not None and meter.predicted_from == (2, 7)
    assert meter.prediction.step_s == pytest.approx(0.195 + 0.1 + 0.02 + 0.015) == pytest.approx(0.33)
    assert said and said[0].startswith("pace: steps 2-7 predict 0.33 s a step (turns-bound)")
    # the rest runs 10% slower: the generation took longer
    run(meter, clock, range(8, 61), {**sync_record(generate=0.233), "searcher/generate_cpu_s": 0.3}, 0.363, 0.5, 0.5)
    s = meter.summary()
    assert s["measured"]["parts"]["generate_cpu_s"] == pytest.approx(0.3)
    assert s["measured"]["parts"]["train_cpu_s"] == pytest.approx(0.2)
    assert set(s) == {"predicted", "measured", "error", "alternatives"}
    assert s["predicted"]["from_steps"] == [2, 7] and s["predicted"]["bound"] == "turns"
    assert s["measured"]["steps"] == 53 and s["measured"]["step_s"] == pytest.approx(0.363)
    assert s["error"] == pytest.approx(s["measured"]["step_s"] / s["predicted"]["step_s"] - 1) == pytest.approx(0.1)
    assert s["measured"]["pause_s"] == pytest.approx(0.5) and s["measured"]["trainer_busy"] == 1.0
    # the whole run's parts (the first step left out), in turn, predict the whole run's mean step
    parts = StepParts(**s["measured"]["parts"])
    whole = (6 * 0.33 + 53 * 0.363) / 59
    assert predict(parts, layout).step_s == pytest.approx(whole)
    assert s["alternatives"]["sync"]["step_s"] == pytest.approx(whole)
    # side by side with one searcher, a step takes the longer of a batch and the trainer's part
    ray1 = s["alternatives"]["ray_1"]
    assert ray1["step_s"] == pytest.approx(parts.generate_s + parts.load_s) and ray1["bound"] == "searchers"
    line = pace_line({**s, "runtime": "sync"})
    assert line.startswith("pace: 0.363 s a step against 0.33 predicted from steps 2-7 (+10%), turns-bound;")
    assert "ray with 2 searcher(s)" in line and "the sync runtime" not in line and "cores" not in line
    # measured on a machine without GPUs: the ray runtime's figures say what they assume
    on_cpu = pace_line({**s, "runtime": "sync", "environment": {"cores": 2, "gpus": []}})
    shared = "(ray's figures share the 2 cores by each part's CPU seconds; Ray's own processes not counted)"
    assert on_cpu.endswith(shared)
    # a run whose parts have no CPU seconds (an older tba's) gave searchers cores of their own
    s["measured"]["parts"].update(generate_cpu_s=0.0, train_cpu_s=0.0)
    older = pace_line({**s, "runtime": "sync", "environment": {"cores": 2, "gpus": []}})
    assert older.endswith("(ray's figures give searchers cores of their own; on 2 cores they share the trainer's)")


def test_the_ray_runtime_reads_a_searchers_batch_from_its_seconds_a_completion_and_its_wait():
    layout = Layout("ray", completions_per_step=64, completions_per_batch=64, searchers=2)
    clock = Clock()
    meter = PaceMeter(layout, clock, steps=30, log=lambda m: None)
    # two searchers of 1 s batches of 64: 128 completions a second; each step waits 0.35 for 0.15 of work
    record = {"train/step_s": 0.1, "trainer/wait_s": 0.35, "weights/load_s": 0.0}
    record["searcher/active_s_per_completion"] = 1 / 64  # their seconds not paused, a completion
    record["searcher/cpu_per_completion_s"] = 1.5 / 64  # a batch keeps 1.5 cores busy
    run(meter, clock, range(1, 31), record, 0.5, cpu=0.3)
    s = meter.summary()
    parts = s["measured"]["parts"]
    assert parts["generate_s"] == pytest.approx(1.0) and parts["overhead_s"] == pytest.approx(0.05)
    assert parts["generate_cpu_s"] == pytest.approx(1.5) and parts["train_cpu_s"] == pytest.approx(0.3)
    assert s["measured"]["trainer_busy"] == pytest.approx(0.3)
    assert s["predicted"]["bound"] == "searchers" and s["predicted"]["step_s"] == pytest.approx(0.5)
    assert s["error"] == pytest.approx(0.0, abs=1e-9)
    assert s["alternatives"]["ray_4"]["step_s"] == pytest.approx(0.25)
    assert s["alternatives"]["sync"]["step_s"] == pytest.approx(1.0 + 0.1 + 0.05)


def test_a_run_too_short_to_hold_steps_out_reports_its_parts_without_a_prediction():
    assert early_steps(8) == 0 and early_steps(11) == 5 and early_steps(1000) == 50
    clock = Clock()
    said = []
    meter = PaceMeter(Layout("sync", 64, 64), clock, steps=8, log=said.append)
    meter.announce()
    assert said == []  # nothing to announce
    run(meter, clock, range(1, 9), sync_record(), 0.33)
    s = meter.summary()
    assert s["predicted"] is None and s["error"] is None and s["measured"]["steps"] == 7
    assert pace_line({**s, "runtime": "sync"}).startswith("pace: 0.33 s a step; this run's parts predict")


def test_a_resumed_run_counts_from_the_step_it_resumed_at():
    clock = Clock()
    said = []
    meter = PaceMeter(Layout("sync", 64, 64), clock, steps=100, first=40, log=said.append)
    assert meter.early == 6
    meter.announce()
    assert said[0].startswith("pace: steps 42-47 will predict the rest")
    run(meter, clock, range(41, 101), sync_record(), 0.33)
    assert meter.predicted_from == (42, 47) and meter.summary()["measured"]["steps"] == 53


def test_print_plan_predicts_this_config_from_the_parts_a_finished_run_measured(tmp_path, capsys):
    from tba.cli import main

    run = tmp_path / "measured"
    run.mkdir()
    parts = {"generate_s": 0.2, "train_s": 0.1, "load_s": 0.0, "publish_s": 0.0, "overhead_s": 0.05}
    summary = {
        "runtime": "sync",
        "measured": {"parts": parts},
        "environment": {"cpu": "Some CPU", "cores": 2, "gpus": []},
    }
    (run / "summary.json").write_text(__import__("json").dumps(summary))
    assert main(["train", "--runtime.type=sync", "--run.device=cpu", "--print-plan", "--parts-from", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(f"pace from the parts of {run} (sync runtime, Some CPU, 2 cores):")
    assert out[at + 1] == "  this run (sync): 0.35 s a step (turns-bound), trainer busy 1.00, mean lag 0 step(s)"
    # the demo's batch is one searcher batch a step: one searcher delivers it in 0.2 s, the trainer's part 0.15
    assert out[at + 3].startswith("  ray with 1 searcher(s): 0.2 s a step (searchers-bound)")
    assert out[at + 4].startswith("  ray with 2 searcher(s): 0.15 s a step (trainer-bound)")
    # parts without CPU seconds, a layout on this machine's cores (the run on its CPU)
    note = f"ray's figures give searchers cores of their own; on {usable_cores()} cores they share the trainer's"
    assert out[at + 6] == f"  ({note})"
    # a layout on GPUs shares no cores: nothing to say about them
    assert main(["train", "--print-plan", "--hardware=8xh100", "--parts-from", str(run)]) == 0
    out = capsys.readouterr().out
    assert "pace from the parts of" in out and "cores" not in out.split("pace from the parts of")[1].split("\n", 1)[1]
    # a folder without measured parts: one line that says so, exit 2
    assert main(["train", "--print-plan", f"--parts-from={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"--parts-from {tmp_path}: no measured parts" in err and "give the folder of a run that finished" in err
