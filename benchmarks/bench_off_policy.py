"""The off-policy study: how each objective holds up as its training data gets staler.

    .venv/bin/python benchmarks/bench_off_policy.py                       # 5 objectives x k in {1,4,16} x 3 seeds
    .venv/bin/python benchmarks/bench_off_policy.py --steps 400 --objectives tb grpo --intervals 1 16
    .venv/bin/python benchmarks/bench_off_policy.py --jobs 2        # two runs at a time, one thread each

Every run is the real CLI on the demo task in the ``sync`` runtime, where the staleness is exact
and independent of machine load: with ``trainer.sync_interval=k`` the searcher samples with
weights published up to k - 1 steps earlier, and the buffer's mix of recent and older prompts
(``buffer.recent_prob``, 0.95 by default) adds older data on top. Everything else (steps, batch,
learning rate, seeds) is the same for every objective. Prints a table of final greedy accuracy
(mean ± std over seeds) and wall-clock per run, and plots accuracy against k to
``<out>/off_policy.png``; raw results go to ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_one(out: Path, objective: str, k: int, seed: int, steps: int, extra: list[str]) -> dict:
    name = f"{objective}-k{k}-s{seed}"
    if (out / name / "summary.json").is_file():  # resumable: finished runs are kept
        summary = json.loads((out / name / "summary.json").read_text())
    else:
        args = [
            sys.executable,
            "-m",
            "tba",
            "train",
            "--runtime.type=sync",
            f"--objective.type={objective}",
            f"--trainer.sync_interval={k}",
            f"--run.seed={seed}",
            f"--trainer.steps={steps}",
            f"--eval.every={steps}",
            f"--run.output_dir={out}",
            f"--run.name={name}",
            "--logging.progress=false",
            *extra,
        ]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"objective": objective, "k": k, "seed": seed, "error": proc.stderr[-2000:]}
        summary = json.loads((out / name / "summary.json").read_text())
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    return {
        "objective": objective,
        "k": k,
        "seed": seed,
        "acc_initial": summary["eval/accuracy_initial"],
        "acc_final": summary["eval/accuracy_final"],
        "wall_s": summary["wall_clock_s"],
        "lag_mean": summary.get("lag_mean"),
        "non_finite_losses": sum(1 for v in losses if v is None),
    }


def build_model(extra: list[str]) -> None:
    """Build (or find cached) the demo model that every run starts from."""
    from tba.config import load_config
    from tba.runtime.components import model_paths

    model_paths(load_config(None, extra), log=lambda msg: None)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objectives", nargs="+", default=["tb", "grpo", "dr_grpo", "ppo", "rloo"])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-off-policy"))
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs side by side; each gets cores/jobs torch threads (default 1)"
    )
    args, extra = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.jobs > 1:
        extra = [f"--run.threads={max(1, (os.cpu_count() or 1) // args.jobs)}", *extra]
    build_model(extra)  # once, before runs that would otherwise race to build it
    grid = [(o, k, s) for s in args.seeds for k in args.intervals for o in args.objectives]
    results, start = [], time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, args.out, o, k, s, args.steps, extra) for o, k, s in grid]
        for future in futures:
            r = future.result()
            results.append(r)
            status = r.get("error", "").strip().splitlines()[-1:] or [f"{r['acc_final']:.1%}"]
            label = f"{r['objective']:>8} k={r['k']:<3} seed {r['seed']}"
            print(f"[{time.time() - start:6.0f} s] {label}: {status[0]}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))

    ok = [r for r in results if "error" not in r]
    initial = statistics.mean(r["acc_initial"] for r in ok) if ok else float("nan")
    print(f"\n{args.steps} trainer steps per run, seeds {args.seeds}; initial accuracy {initial:.1%}\n")
    print("| objective | " + " | ".join(f"k={k}: final accuracy" for k in args.intervals) + " | mean wall-clock s |")
    print("|---|" + "---:|" * (len(args.intervals) + 1))
    for objective in args.objectives:
        cells = []
        for k in args.intervals:
            accs = [r["acc_final"] for r in ok if r["objective"] == objective and r["k"] == k]
            failed = sum(1 for r in results if r["objective"] == objective and r["k"] == k and "error" in r)
            m, s = mean_std(accs) if accs else (float("nan"), 0.0)
            cells.append(f"{m:.1%} ± {s:.1%}" + (f" ({failed} failed)" if failed else ""))
        walls = [r["wall_s"] for r in ok if r["objective"] == objective]
        print(f"| {objective} | " + " | ".join(cells) + f" | {statistics.mean(walls):.0f} |")
    bad = [r for r in ok if r["non_finite_losses"]]
    print(f"\nruns with a non-finite loss: {len(bad)} of {len(ok)}; failed runs: {len(results) - len(ok)}")
    plot(ok, args, args.out / "off_policy.png")
    print(f"plot: {args.out / 'off_policy.png'}")


def plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for objective in args.objectives:
        xs, ms, ss = [], [], []
        for k in args.intervals:
            accs = [r["acc_final"] for r in results if r["objective"] == objective and r["k"] == k]
            if accs:
                m, s = mean_std(accs)
                xs.append(k)
                ms.append(m)
                ss.append(s)
        ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=objective)
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.intervals, [str(k) for k in args.intervals])
    ax.set_xlabel("sync interval k (staleness of the sampler's weights)")
    ax.set_ylabel(f"final greedy accuracy after {args.steps} steps")
    ax.set_title("demo task: accuracy against off-policyness")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
