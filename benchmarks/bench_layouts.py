"""Which layout is fastest where searchers share the trainer's cores: the sync runtime against the
ray runtime with each split of the cores and with searchers capped to what the trainer draws.

    .venv/bin/python benchmarks/bench_layouts.py run --settings demo --seeds 0 1 2
    .venv/bin/python benchmarks/bench_layouts.py run --settings real --seeds 0 --real-backend vllm
    .venv/bin/python benchmarks/bench_layouts.py report

Each run is the real command line (``tba train``, the settings of ``bench_async_regimes.py``: the
demo, and SmolLM2-135M-Instruct on the word problems), one at a time, in its own process. Arms:

- ``sync``: generate, then train, each with every core (what ``runtime.type: auto`` takes on a
  machine without a GPU);
- ``auto``: no runtime named (checks that it is the sync runtime's speed here);
- ``ray``: a searcher on one core, the trainer on the rest (the default split);
- ``ray_t2``: the trainer on every core as well (the two oversubscribe the cores);
- ``ray_ahead1``: the default split, searchers paused while a step's worth of groups waits
  (``runtime.max_ahead=1``);
- ``ray_ahead1_t2``: the cap, the trainer on every core: the trainer's threads have the cores
  while the searcher waits.

Printed per setting and arm, over the seeds (mean, ± the standard deviation where there are two or
more for the ratio, the gain and the sampled reward): wall-clock of the whole command, its ratio to sync's
at the same seed (above 1: faster than sync), the gain of the greedy evaluation, the searchers'
reward over the last ten logged steps (learning per step where the evaluation reaches the task's
ceiling), the trainer's mean lag, the searchers' completions per completion the trainer drew (above
1: they made data it never drew), the seconds searchers paused, the trainer's median step and the
median seconds a publication held the trainer. Results go to ``--out``/results.json with the
machine (a run again replaces its row).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import ROOT, machine_line, outcome, parse_with_overrides, print_machine, results_folder, sampled
from harness.study import SEEDS, Arm, Column, Results, Trial, run_study, setting_arms, table

from tba.config import load_config

ARMS: dict[str, tuple[str | None, list[str]]] = {  # name -> (runtime.type, other overrides)
    "sync": ("sync", []),
    "auto": (None, []),
    "ray": ("ray", []),
    "ray_t2": ("ray", ["--runtime.trainer_cpus=2"]),
    "ray_ahead1": ("ray", ["--runtime.max_ahead=1"]),
    "ray_ahead1_t2": ("ray", ["--runtime.max_ahead=1", "--runtime.trainer_cpus=2"]),
}


def arms(setting: str, names: list[str], seeds: list[int]) -> list[Arm]:
    """``names`` of :data:`ARMS` in ``setting`` (:data:`harness.settings.SETTINGS`)."""
    return setting_arms(setting, ARMS, names, seeds)


def run(trial: Trial, out: Path, extra: list[str]) -> dict:
    setting, arm = trial.arm.fields["setting"], trial.arm.fields["arm"]
    metric = "eval/reward" if setting == "real" else "eval/accuracy"
    name = trial.name
    args = [*trial.args, "--logging.progress=false", *extra]
    done = trial.train(out, ["--logging.progress=false", *extra], cwd=ROOT, clear=True)
    summary, rows = done.summary(), done.steps()
    config = json.loads((out / name / "plan.json").read_text())
    cfg = load_config(out / name / "config.yaml", [])
    drawn = len(rows) * cfg.trainer.batch_prompts * cfg.generation.group_size or None
    last = rows[-1] if rows else {}
    made = last.get("searcher/completions")
    published = [r["train/publish_s"] for r in rows if "train/publish_s" in r]
    return {
        "setting": setting,
        "arm": arm,
        "seed": trial.seed,
        "runtime": config["runtime"],
        **outcome(summary, metric),
        **sampled(out / name),
        "wall_clock_s": round(done.wall_s, 1),
        "step_s_median": statistics.median(r["train/step_s"] for r in rows) if rows else None,
        "publish_s_median": statistics.median(published) if published else None,
        "made_per_drawn": made / drawn if made and drawn else None,
        "paused_s": last.get("searcher/paused_s"),
        "startup_s": summary.get("startup_s"),
        "command": " ".join(["tba train", *([str(trial.arm.config)] if trial.arm.config else []), *args]),
    }


def columns(rows: list[dict]) -> list[Column]:
    """The table's columns; ``vs sync`` is sync's wall-clock at the same setting and seed over the run's."""
    sync = {(r["setting"], r["seed"]): r["wall_clock_s"] for r in rows if r["arm"] == "sync"}

    def ratio(r: dict) -> float | None:
        wall = sync.get((r["setting"], r["seed"]))
        return None if wall is None else wall / r["wall_clock_s"]

    return [
        Column("arm", "arm", "first", ""),
        Column("runtime", "runtime", "first", ""),
        SEEDS,
        Column("wall, s", "wall_clock_s", "mean", ".0f"),
        Column("vs sync", ratio, spec=".2f", suffix="x"),
        Column("gain", "gain"),
        Column("sampled, last 10", "sampled_last10"),
        Column("lag", "lag_mean", "mean", ".2f"),
        Column("made / drawn", "made_per_drawn", "mean", ".2f"),
        Column("paused, s", "paused_s", "mean", ".0f"),
        Column("step, s", "step_s_median", "mean", ".2f"),
        Column("publish on path, s", "publish_s_median", "mean", ".3f"),
    ]


def report(rows: list[dict], environment: dict | None) -> None:
    print(f"machine: {machine_line(environment)}" if environment else "machine: unknown")
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = sorted(
            (r for r in rows if r["setting"] == setting and r["arm"] in ARMS),
            key=lambda r: (list(ARMS).index(r["arm"]), r["seed"]),
        )
        print(f"\n### {setting}\n")
        print(table(mine, ("arm",), columns(rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--settings", nargs="+", default=["demo"], choices=["demo", "real"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--real-backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "layouts")
    a, extra = parse_with_overrides(parser)
    path = results_folder(a.out, "the run directories: only results.json is kept")
    results = Results(path, ("setting", "arm", "seed"))
    results.head["environment"] = json.loads(path.read_text()).get("environment") if path.is_file() else None
    if a.command == "run":
        results.head["environment"] = print_machine()
        for setting in a.settings:
            backend = ["--generation.backend=vllm"] if setting == "real" and a.real_backend == "vllm" else []
            # arms side by side at each seed: the machine drifts less between them
            run_study(
                arms(setting, a.arms, a.seeds),
                lambda t, backend=backend: run(t, a.out / "runs", [*backend, *extra]),
                results,
                order="seed",
                resume=False,
                echo=lambda row: json.dumps({k: v for k, v in row.items() if k != "command"}),
            )
    report(results.rows, results.head["environment"])


if __name__ == "__main__":
    main()
