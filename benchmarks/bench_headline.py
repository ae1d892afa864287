"""The README's headline figures, as means ± std over seeds from the shipped demo models.

Each run is the real command line in its own process (``tba train`` with the figure's config and
``--run.seed``), one after another so that runs do not share the cores; the table gives each run's
first and last greedy evaluation, the gain, the wall-clock time and the trained lag (ray), marks a
run that ends below its start, and names the machine. Ray runs vary with timing (how far the
searcher runs ahead of the trainer): their spread is part of the figure.

    python benchmarks/bench_headline.py                      # every figure, seeds 0 1 2
    python benchmarks/bench_headline.py demo --runtimes sync # one figure, one runtime

Figures: ``demo`` (``tba train``, 600 steps, both runtimes), ``example`` (``configs/custom_task.yaml``,
the sync runtime it sets), ``tools`` (``configs/tools.yaml``, both runtimes). Results go to
``benchmarks/results/headline/results.json`` after each run (a rerun skips the runs already there;
``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tba.config import load_config
from tba.machine import describe_machine, machine_line
from tba.metrics import read_metrics
from tba.plan.auto import stale_by_design, tb_trust_region

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {  # name -> (config file or None, metric, runtimes it runs in)
    "demo": (None, "eval/accuracy", ("sync", "ray")),
    "example": ("configs/custom_task.yaml", "eval/reward", ("sync",)),
    "tools": ("configs/tools.yaml", "eval/accuracy", ("sync", "ray")),
}


def train(args: list[str], out: Path, name: str) -> tuple[dict, float]:
    """``tba train`` with ``args`` in its own process, into ``out``/``name``: its summary and the
    command's wall-clock in seconds. A failed run stops the benchmark with the run's last error."""
    shutil.rmtree(out / name, ignore_errors=True)  # an interrupted run's leftovers
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "tba", "train", *args, f"--run.output_dir={out}", f"--run.name={name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TERM": "dumb"},
    )
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / name / "summary.json").read_text()), wall


def outcome(summary: dict, metric: str) -> dict:
    """A run's evaluation before and after training, from its ``summary.json``."""
    first, last = summary[f"{metric}_initial"], summary[f"{metric}_final"]
    return {
        "metric": metric,
        "initial": first,
        "final": last,
        "gain": last - first,
        "below_start": last < first,
        "lag_mean": summary.get("lag_mean"),
    }


def band(run_dir: Path) -> str:
    """The band the run trained with, ``auto`` resolved from its saved config ("none": plain TB)."""
    cfg = load_config(run_dir / "config.yaml", [])
    return str(tb_trust_region(cfg.objective, stale_by_design(cfg))).lower()


def sampled(run_dir: Path) -> dict:
    """The searchers' reward (and exact answers, where the task logs them) over the run's first and
    last ten logged steps: what sampling made of the training, beside the greedy evaluation."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    found = {}
    for key, name in (("searcher/reward_mean", "sampled"), ("reward/exact_mean", "exact")):
        values = [r[key] for r in rows if key in r]
        if len(values) >= 20:
            found[f"{name}_first10"] = statistics.mean(values[:10])
            found[f"{name}_last10"] = statistics.mean(values[-10:])
    return found


def run(figure: str, runtime: str, seed: int, out: Path, extra: list[str]) -> dict:
    config, metric, _ = FIGURES[figure]
    name = f"{figure}-{runtime}-seed{seed}"
    args = [
        *([config] if config else []),
        f"--runtime.type={runtime}",
        f"--run.seed={seed}",
        "--logging.progress=false",
    ]
    summary, wall = train([*args, *extra], out, name)
    args += [f"--run.output_dir={out}", f"--run.name={name}"]
    return {
        "figure": figure,
        "runtime": runtime,
        "seed": seed,
        **outcome(summary, metric),
        "wall_clock_s": round(wall, 1),
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
        finals = [r["final"] for r in rs]
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        each = ", ".join(f"{r['final']:.3f}{' (below start)' if r['below_start'] else ''}" for r in rs)
        lags = [r["lag_mean"] for r in rs if r["lag_mean"] is not None]
        lag = f"{statistics.mean(lags):.2f}" if lags else "-"
        lines.append(
            f"| {figure} | {runtime} | {','.join(str(r['seed']) for r in rs)} | {rs[0]['initial']:.3f} "
            f"| {statistics.mean(finals):.3f} ± {std:.3f} | {statistics.mean(r['gain'] for r in rs):+.3f} | {each} "
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
    a, extra = parser.parse_known_args()  # what is left: overrides passed to every run (after --)
    extra = [x for x in extra if x != "--"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / ".gitignore").write_text("# run directories of bench_headline.py: only results.json is kept\n*/\n")
    results_path = a.out / "results.json"
    kept = json.loads(results_path.read_text()) if results_path.is_file() and not a.fresh else {}
    rows = kept.get("runs", [])
    environment = describe_machine()
    print(f"machine: {machine_line(environment)}", flush=True)
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
