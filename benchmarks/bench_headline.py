"""The README's headline figures, as means ± std over seeds from the shipped demo models.

Each run is the real command line in its own process (``tba train`` with the figure's config and
``--run.seed``), one after another so that runs do not share the cores; the table gives each run's
first and last greedy evaluation, the gain, the wall-clock time and the trained lag (ray), marks a
run that ends below its start, and names the machine. Ray runs vary with timing (how far the
searcher runs ahead of the trainer): their spread is part of the figure.

    python benchmarks/bench_headline.py                      # every figure, seeds 0 1 2
    python benchmarks/bench_headline.py demo --runtimes sync # one figure, one runtime

Figures: ``demo`` (``tba train``, 600 steps, both runtimes), ``example`` (``configs/custom_task.yaml``,
the sync runtime it sets), ``tools`` (``configs/tools.yaml``, both runtimes), ``reasoning_gym_demo``
(``configs/reasoning_gym_demo.yaml``, the demo model on reasoning-gym's sums) and ``reasoning_gym``
(``configs/reasoning_gym.yaml``: SmolLM2-135M-Instruct, whose set-up the config names), both in
the sync runtime, with ``--out benchmarks/results/reasoning_gym``. Results go to
``benchmarks/results/headline/results.json`` after each run (a rerun skips the runs already there;
``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import ROOT, outcome, parse_with_overrides, print_machine, results_folder, sampled
from harness.study import SEEDS, Arm, Column, Results, Trial, run_study, table

from tba.config import load_config
from tba.plan.auto import stale_by_design, tb_trust_region

FIGURES = {  # name -> (config file or None, metric, runtimes it runs in)
    "demo": (None, "eval/accuracy", ("sync", "ray")),
    "example": ("configs/custom_task.yaml", "eval/reward", ("sync",)),
    "tools": ("configs/tools.yaml", "eval/accuracy", ("sync", "ray")),
    "reasoning_gym_demo": ("configs/reasoning_gym_demo.yaml", "eval/reward", ("sync",)),
    "reasoning_gym": ("configs/reasoning_gym.yaml", "eval/reward", ("sync",)),
}
COLUMNS = [
    Column("figure", "figure", "first", ""),
    Column("runtime", "runtime", "first", ""),
    SEEDS,
    Column("start", "initial", "first"),
    Column("final (mean ± std)", "final", "std"),
    Column("gain", "gain", "mean", "+.3f"),
    Column("runs", lambda r: f"{r['final']:.3f}{' (below start)' if r['below_start'] else ''}", "each", ""),
    Column("lag", "lag_mean", "mean", ".2f"),
    Column("wall-clock s", "wall_clock_s", "mean", ".0f"),
]


def arms(figures: list[str], runtimes: list[str], seeds: list[int]) -> list[Arm]:
    """A figure in each of ``runtimes`` that it runs in."""
    return [
        Arm(
            f"{figure}-{runtime}",
            runtime,
            config=FIGURES[figure][0],
            seeds=seeds,
            fields={"figure": figure, "runtime": runtime},
        )
        for figure in figures
        for runtime in runtimes
        if runtime in FIGURES[figure][2]
    ]


def band(run_dir: Path) -> str:
    """The band the run trained with, ``auto`` resolved from its saved config ("none": plain TB)."""
    cfg = load_config(run_dir / "config.yaml", [])
    return str(tb_trust_region(cfg.objective, stale_by_design(cfg))).lower()


def run(trial: Trial, out: Path, extra: list[str]) -> dict:
    figure, runtime = trial.arm.fields["figure"], trial.arm.runtime
    config, metric, _ = FIGURES[figure]
    args = [*([config] if config else []), *trial.args, "--logging.progress=false"]
    done = trial.train(out, ["--logging.progress=false", *extra], cwd=ROOT, clear=True)
    args += [f"--run.output_dir={out}", f"--run.name={trial.name}"]
    return {
        "figure": figure,
        "runtime": runtime,
        "seed": trial.seed,
        **outcome(done.summary(), metric),
        "wall_clock_s": round(done.wall_s, 1),
        "tb_trust_region": band(done.run_dir),
        **sampled(done.run_dir),
        "command": " ".join(["tba train", *args, *extra]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="*", default=list(FIGURES), choices=list(FIGURES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runtimes", nargs="+", default=["sync", "ray"], choices=["sync", "ray"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "headline")
    parser.add_argument("--fresh", action="store_true", help="forget the runs already in results.json")
    a, extra = parse_with_overrides(parser)
    results_path = results_folder(a.out, "run directories of bench_headline.py: only results.json is kept")
    results = Results(results_path, ("figure", "runtime", "seed"), fresh=a.fresh)
    results.head["environment"] = print_machine()
    rows = run_study(arms(a.figures, a.runtimes, a.seeds), lambda t: run(t, a.out / "runs", extra), results)
    chosen = [r for r in rows if r["figure"] in a.figures and r["runtime"] in a.runtimes and r["seed"] in a.seeds]
    print(table(chosen, ("figure", "runtime"), COLUMNS))


if __name__ == "__main__":
    main()
