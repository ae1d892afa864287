"""Batch against streaming searchers end to end: the ray runtime at equal trainer steps.

    .venv/bin/python benchmarks/bench_streaming_e2e.py                       # demo and worked chains, seeds 0 1
    .venv/bin/python benchmarks/bench_streaming_e2e.py --tasks demo --seeds 0 --steps 100   # a short look
    .venv/bin/python benchmarks/bench_streaming_e2e.py report

Each run is the real CLI (``tba train``, ray runtime) with only ``generation.stream`` (and the
seed, and the task) changed; with the HF backend the streaming searcher runs on transformers'
continuous batching (``generation.hf_stream: continuous``). Tasks: ``demo`` (the built-in default:
2-digit sums, answers of 2-4 tokens) and ``chains`` (worked chains: 5 one-digit terms, completions
of about 28 tokens, up to 40). Kept per run, in ``<out>/<task>-<mode>-s<seed>.json``: greedy
accuracy before and after, wall-clock of the whole run and of the training loop, the trainer's
busy fraction and its wait for data, and the searcher's completions and tokens per second, engine
busy fraction, group latency p50 / p95 (stream), versions per group, and the machine. A run
already kept is not run again: the study resumes. Run it alone on the machine (the ray runtime
splits the cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from harness import ROOT, describe_machine, fmt, print_machine, rule, train

TASKS = {
    "demo": [],
    "chains": ["--task.terms=5", "--task.digits=1", "--task.show_work=true", "--generation.max_new_tokens=40"],
}
SEARCHER_KEYS = (
    "searcher/completions_per_s",
    "searcher/tokens_per_s",
    "searcher/engine_busy",
    "searcher/group_latency_p50_s",
    "searcher/group_latency_p95_s",
    "searcher/versions_per_group",
)


def run(out: Path, task: str, mode: str, seed: int, steps: int | None, extra: list[str]) -> dict:
    name = f"{task}-{mode}-s{seed}"
    kept = out / f"{name}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    with tempfile.TemporaryDirectory(prefix="tba-stream-e2e-") as tmp:
        args = ["--runtime.type=ray", f"--run.seed={seed}", "--logging.progress=false"]
        args += [f"--generation.stream={'true' if mode == 'stream' else 'false'}", *TASKS[task], *extra]
        args += [f"--trainer.steps={steps}", f"--eval.every={steps}"] if steps else []
        done = train(args, Path(tmp), name)
        summary, steps_logged = done.summary(), done.steps()
    last = steps_logged[-1]
    row = {
        "task": task,
        "mode": mode,
        "seed": seed,
        "steps": summary["trainer_steps"],
        "acc_initial": summary["eval/accuracy_initial"],
        "acc_final": summary["eval/accuracy_final"],
        "wall_s": round(done.wall_s, 1),
        "loop_s": round(steps_logged[-1]["time_s"] - steps_logged[0]["time_s"], 1),
        "trainer_busy": summary.get("trainer_busy_fraction"),
        "trainer_wait_s": summary.get("trainer_wait_s"),
        "lag_mean": summary.get("lag_mean"),
        **{k.split("/")[1]: last.get(k) for k in SEARCHER_KEYS},
    }
    out.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(row | {"environment": describe_machine()}, indent=1) + "\n")
    return row


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r.get(key) for r in rows]
    return statistics.mean(values) if values and None not in values else None


def report(out: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*-s*.json"))]
    if not rows:
        sys.exit(f"nothing kept in {out} yet")
    print("| task | searcher | seeds | accuracy before → after | loop s | trainer busy | completions/s | "
          "engine busy | group latency p50 / p95 s |")  # fmt: skip
    print(rule("llrlrrrrl"))
    for task in TASKS:
        for mode in ("batch", "stream"):
            rs = [r for r in rows if r["task"] == task and r["mode"] == mode]
            if not rs:
                continue
            accs = ", ".join(f"{r['acc_final']:.1%}" for r in rs)
            lat = f"{fmt(mean_of(rs, 'group_latency_p50_s'), '.2f')} / {fmt(mean_of(rs, 'group_latency_p95_s'), '.2f')}"
            loop = fmt(mean_of(rs, "loop_s"), ".0f")
            print(
                f"| {task} | {mode} | {len(rs)} | {rs[0]['acc_initial']:.1%} → {accs} | {loop} | "
                f"{fmt(mean_of(rs, 'trainer_busy'), '.2f')} | {fmt(mean_of(rs, 'completions_per_s'), '.0f')} | "
                f"{fmt(mean_of(rs, 'engine_busy'), '.2f')} | {lat} |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="run", choices=["run", "report"])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: the task's demo default)")
    p.add_argument("--extra", action="append", default=[], help="one more tba train argument (repeatable)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "streaming" / "e2e")
    a = p.parse_args()
    if a.what == "run":
        print_machine()
        for task in a.tasks:
            for seed in a.seeds:
                for mode in ("batch", "stream"):
                    row = run(a.out, task, mode, seed, a.steps, a.extra)
                    print(json.dumps(row), flush=True)
    report(a.out)


if __name__ == "__main__":
    main()
