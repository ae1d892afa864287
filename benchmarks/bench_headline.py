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
import json
import statistics
from pathlib import Path

from harness import (
    ROOT,
    fmt,
    load_results,
    outcome,
    parse_with_overrides,
    print_machine,
    results_folder,
    sampled,
    spread,
    train,
)

from tba.config import load_config
from tba.plan.auto import stale_by_design, tb_trust_region

FIGURES = {  # name -> (config file or None, metric, runtimes it runs in)
    "demo": (None, "eval/accuracy", ("sync", "ray")),
    "example": ("configs/custom_task.yaml", "eval/reward", ("sync",)),
    "tools": ("configs/tools.yaml", "eval/accuracy", ("sync", "ray")),
    "reasoning_gym_demo": ("configs/reasoning_gym_demo.yaml", "eval/reward", ("sync",)),
    "reasoning_gym": ("configs/reasoning_gym.yaml", "eval/reward", ("sync",)),
}


def band(run_dir: Path) -> str:
    """The band the run trained with, ``auto`` resolved from its saved config ("none": plain TB)."""
    cfg = load_config(run_dir / "config.yaml", [])
    return str(tb_trust_region(cfg.objective, stale_by_design(cfg))).lower()


def run(figure: str, runtime: str, seed: int, out: Path, extra: list[str]) -> dict:
    config, metric, _ = FIGURES[figure]
    name = f"{figure}-{runtime}-seed{seed}"
    args = [
        *([config] if config else []),
        f"--runtime.type={runtime}",
        f"--run.seed={seed}",
        "--logging.progress=false",
    ]
    done = train([*args, *extra], out, name, cwd=ROOT, clear=True)
    args += [f"--run.output_dir={out}", f"--run.name={name}"]
    return {
        "figure": figure,
        "runtime": runtime,
        "seed": seed,
        **outcome(done.summary(), metric),
        "wall_clock_s": round(done.wall_s, 1),
        "tb_trust_region": band(out / name),
        **sampled(out / name),
        "command": " ".join(["tba train", *args, *extra]),
    }


def table(rows: list[dict]) -> str:
    header = "| figure | runtime | seeds | start | final (mean ± std) | gain | runs | lag | wall-clock s |"
    lines = [header, "|---" * 9 + "|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["figure"], r["runtime"]), []).append(r)
    for (figure, runtime), rs in groups.items():
        each = ", ".join(f"{r['final']:.3f}{' (below start)' if r['below_start'] else ''}" for r in rs)
        lags = [r["lag_mean"] for r in rs if r["lag_mean"] is not None]
        lag = fmt(statistics.mean(lags) if lags else None)
        final = spread([r["final"] for r in rs], always_std=True)
        lines.append(
            f"| {figure} | {runtime} | {','.join(str(r['seed']) for r in rs)} | {rs[0]['initial']:.3f} "
            f"| {final} | {statistics.mean(r['gain'] for r in rs):+.3f} | {each} "
            f"| {lag} | {statistics.mean(r['wall_clock_s'] for r in rs):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="*", default=list(FIGURES), choices=list(FIGURES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runtimes", nargs="+", default=["sync", "ray"], choices=["sync", "ray"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "headline")
    parser.add_argument("--fresh", action="store_true", help="forget the runs already in results.json")
    a, extra = parse_with_overrides(parser)
    results_path = results_folder(a.out, "run directories of bench_headline.py: only results.json is kept")
    rows = load_results(results_path, a.fresh).get("runs", [])
    environment = print_machine()
    for figure in a.figures:
        for runtime in (r for r in a.runtimes if r in FIGURES[figure][2]):
            for seed in a.seeds:
                if any(r["figure"] == figure and r["runtime"] == runtime and r["seed"] == seed for r in rows):
                    continue
                row = run(figure, runtime, seed, a.out / "runs", extra)
                print(json.dumps(row), flush=True)
                rows.append(row)
                results_path.write_text(json.dumps({"environment": environment, "runs": rows}, indent=1) + "\n")
    chosen = [r for r in rows if r["figure"] in a.figures and r["runtime"] in a.runtimes and r["seed"] in a.seeds]
    print(table(chosen))


if __name__ == "__main__":
    main()
