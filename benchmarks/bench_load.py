"""The demo on a quiet machine and beside a CPU hog, with the replay and staleness bounds off and on.

    .venv/bin/python benchmarks/bench_load.py                       # 2 seeds x quiet/loaded x off/on
    .venv/bin/python benchmarks/bench_load.py --seeds 0 --steps 300
    .venv/bin/python benchmarks/bench_load.py --objective tb_trust_seq --machines loaded \
        --out benchmarks/results/load_tb_trust_seq      # another objective setting, only beside the hog

Each run is the real CLI (``tba train``, the demo's defaults on the ray runtime) with only the seed,
the bounds and the machine's load changed. "loaded": a busy-loop process (one core) runs beside the
whole run; the script starts it before the run and stops it after. "off" is
``--trainer.max_replay_ratio=null --runtime.max_lag=null`` (the trainer never waits: the behaviour
before the bounds); "on" is the defaults. Printed per run: final greedy accuracy, wall-clock,
replay ratio over the run (trained samples per delivered sample), mean lag of trained data, the
largest lag of data on arrival, and the trainer's total wait. Results go to ``--out``/results.json,
one entry per run as it finishes; a rerun skips the runs already there (``--fresh`` starts over).
``--objective`` trains with one of ``OBJECTIVES``' settings instead of the demo's plain ``tb``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from harness import print_machine, train
from harness.measure import hog

OFF = ["--trainer.max_replay_ratio=null", "--runtime.max_lag=null"]
# plain trajectory balance, and its trust regions for stale data
OBJECTIVES = {
    "tb": ["--objective.tb_trust_region=null"],
    "tb_trust": ["--objective.tb_trust_region=0.2", "--objective.tb_trust_region_sequence=false"],
    "tb_trust_seq": ["--objective.tb_trust_region=0.2", "--objective.tb_trust_region_sequence=true"],
}


def run(out: Path, name: str, seed: int, loaded: bool, bounds: bool, steps: int | None, objective: str = "tb") -> dict:
    args = ["--runtime.type=ray", f"--run.seed={seed}", *OBJECTIVES[objective], "--logging.progress=false"]
    args += ([] if bounds else OFF) + ([f"--trainer.steps={steps}"] if steps else [])
    busy = hog() if loaded else None
    try:
        done = train(args, out, name)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    summary, steps_logged = done.summary(), done.steps()
    return {
        "name": name,
        "objective": objective,
        "seed": seed,
        "loaded": loaded,
        "bounds": bounds,
        "wall_s": round(done.wall_s, 1),
        "accuracy_initial": summary["eval/accuracy_initial"],
        "accuracy_final": summary["eval/accuracy_final"],
        "replay_ratio": summary["replay_ratio"],
        "lag_mean": summary["lag_mean"],
        "arrival_lag_max": max(r["buffer/arrival_lag_max"] for r in steps_logged),
        "wait_s": summary["trainer_wait_s"],
        "completions": steps_logged[-1]["searcher/completions"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| machine | bounds | seed | accuracy | wall s | replay ratio | lag mean | arrival lag max | wait s "
        "| completions |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {'loaded' if r['loaded'] else 'quiet'} | {'on' if r['bounds'] else 'off'} | {r['seed']} | "
            f"{r['accuracy_initial']:.1%} -> {r['accuracy_final']:.1%} | {r['wall_s']:.0f} | {r['replay_ratio']:.2f} | "
            f"{r['lag_mean']:.1f} | {r['arrival_lag_max']:.0f} | {r['wait_s']:.0f} | {r['completions']:,.0f} |"
        )
    lines += ["", "| machine | bounds | accuracy (mean of seeds) | wall s | replay ratio |", "|---|---|---:|---:|---:|"]
    for loaded in (False, True):
        for bounds in (False, True):
            group = [r for r in rows if r["loaded"] == loaded and r["bounds"] == bounds]
            if group:
                acc = statistics.mean(r["accuracy_final"] for r in group)
                wall = statistics.mean(r["wall_s"] for r in group)
                replay = statistics.mean(r["replay_ratio"] for r in group)
                machine, on = "loaded" if loaded else "quiet", "on" if bounds else "off"
                lines.append(f"| {machine} | {on} | {acc:.1%} | {wall:.0f} | {replay:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/load"))
    p.add_argument("--fresh", action="store_true", help="forget earlier results in --out")
    p.add_argument("--objective", choices=list(OBJECTIVES), default="tb", help="the objective's setting")
    p.add_argument("--machines", nargs="+", choices=["quiet", "loaded"], default=["quiet", "loaded"])
    a = p.parse_args()
    environment = print_machine()
    a.out.mkdir(parents=True, exist_ok=True)
    if not (a.out / ".gitignore").exists():
        (a.out / ".gitignore").write_text("# run directories of bench_load.py: only results.json is kept\n*/\n")
    results_path = a.out / "results.json"
    done = [] if a.fresh or not results_path.is_file() else json.loads(results_path.read_text())["runs"]
    for seed in a.seeds:
        for loaded in [machine == "loaded" for machine in a.machines]:
            for bounds in (False, True):
                name = f"{'loaded' if loaded else 'quiet'}-{'on' if bounds else 'off'}-s{seed}"
                if any(r["name"] == name for r in done):
                    continue
                shutil.rmtree(a.out / name, ignore_errors=True)  # an unfinished earlier attempt
                row = run(a.out, name, seed, loaded, bounds, a.steps, a.objective)
                done.append(row)
                result = {"command": " ".join(sys.argv), "environment": environment, "runs": done}
                results_path.write_text(json.dumps(result, indent=2) + "\n")
                print(f"{name}: {row['accuracy_final']:.1%} in {row['wall_s']:.0f} s, replay {row['replay_ratio']:.2f}")
    print(table(done))


if __name__ == "__main__":
    main()
