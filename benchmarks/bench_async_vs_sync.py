"""Asynchronous (ray) against synchronous training of the demo, at equal trainer steps and batch.

    .venv/bin/python benchmarks/bench_async_vs_sync.py                  # the demo defaults
    .venv/bin/python benchmarks/bench_async_vs_sync.py --steps 300 --seeds 0 1

Each run is the real CLI (``tba train``) with only ``runtime.type`` and the seed changed. The
demo model is built (and cached) before the first timed run, so both runtimes start from the
same cached checkpoint. Printed per run: wall-clock of the whole run (Ray start-up included for
the async one), time from the first to the last trainer step, median trainer step time, final
greedy accuracy, and the async trainer's busy fraction; then the speedup ratios. The runs' curves
(``tba plot``) go to ``<out>/curves/``; eval accuracy against wall-clock is also copied to
``<out>/async_vs_sync.png``.

What bounds the speedup: the sync runtime does generate-then-train on all cores; the async one
runs the two side by side, each on its share of the cores, so its step time is the slower of
"train on fewer threads" and "generate on fewer threads". The script prints the sync step's
two parts and the async trainer step to show where the time goes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from harness import print_machine, rule, train


def run(out: Path, name: str, runtime: str, seed: int, extra: list[str]) -> dict:
    args = [f"--runtime.type={runtime}", f"--run.seed={seed}", "--logging.progress=false", *extra]
    done = train(args, out, name)
    summary, steps = done.summary(), done.steps()
    return {
        "name": name,
        "runtime": runtime,
        "seed": seed,
        "wall_s": done.wall_s,
        "loop_s": steps[-1]["time_s"] - steps[0]["time_s"],
        "step_s": statistics.median(r["train/step_s"] for r in steps),
        "generate_s": statistics.median(r["searcher/generate_s"] for r in steps) if runtime == "sync" else None,
        "acc_initial": summary["eval/accuracy_initial"],
        "acc_final": summary["eval/accuracy_final"],
        "busy": summary.get("trainer_busy_fraction"),
    }


def plot(results: list[dict], out: Path) -> Path:
    """Compare the runs with ``tba plot``'s figures in ``<out>/curves/``; copy the evaluation against
    wall-clock to ``<out>/async_vs_sync.png`` and return that path."""
    from tba.plots import plot_runs

    names = [f"{r['runtime']} (seed {r['seed']})" for r in results]
    plot_runs([out / r["name"] for r in results], out / "curves", names=names)
    path = out / "async_vs_sync.png"
    shutil.copyfile(out / "curves" / "eval_vs_time.png", path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async-vs-sync"))
    args, extra = parser.parse_known_args()
    print_machine()
    if args.steps:
        extra.append(f"--trainer.steps={args.steps}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    # build the demo model outside the timed runs
    train(["--runtime.type=sync", "--trainer.steps=1", "--logging.progress=false"], args.out, f"warmup-{stamp}")
    results = []
    for seed in args.seeds:
        for runtime in ("sync", "ray"):
            r = run(args.out, f"{runtime}-s{seed}-{stamp}", runtime, seed, extra)
            results.append(r)
            print(
                f"{r['name']}: {r['wall_s']:.1f} s, accuracy {r['acc_initial']:.1%} -> {r['acc_final']:.1%}", flush=True
            )

    print()
    print(
        "| runtime | seed | wall-clock s | first-to-last step s | median step s | sync generate s "
        "| accuracy initial | accuracy final | trainer busy fraction |"
    )
    print(rule("lrrrrrrrr"))
    for r in results:
        gen = f"{r['generate_s']:.3f}" if r["generate_s"] is not None else "-"
        busy = f"{r['busy']:.3f}" if r["busy"] is not None else "-"
        print(
            f"| {r['runtime']} | {r['seed']} | {r['wall_s']:.1f} | {r['loop_s']:.1f} | {r['step_s']:.3f} | {gen} "
            f"| {r['acc_initial']:.1%} | {r['acc_final']:.1%} | {busy} |"
        )
    print()
    for seed in args.seeds:
        s = next(r for r in results if r["seed"] == seed and r["runtime"] == "sync")
        a = next(r for r in results if r["seed"] == seed and r["runtime"] == "ray")
        print(
            f"seed {seed}: speedup {s['wall_s'] / a['wall_s']:.2f}x wall-clock, "
            f"{s['loop_s'] / a['loop_s']:.2f}x first-to-last step; "
            f"final accuracy sync {s['acc_final']:.1%}, async {a['acc_final']:.1%} "
            f"({(a['acc_final'] - s['acc_final']) * 100:+.1f} points); async busy fraction {a['busy']:.3f}"
        )
    print(f"plot: {plot(results, args.out)} (every curve: {args.out / 'curves'})")


if __name__ == "__main__":
    main()
