"""The tool-use demo: accuracy with and without the calculator, before and after RL; and the ray
runtime against sync when every tool call takes 0.2 s.

    .venv/bin/python benchmarks/bench_tools.py                    # both parts
    .venv/bin/python benchmarks/bench_tools.py --part accuracy --steps 200
    .venv/bin/python benchmarks/bench_tools.py --part slow-tool --slow-steps 60

Every run is the real CLI on ``configs/tools.yaml`` (``builtin:tiny-tools``: the demo's tiny Llama
warm-started on calculator traces, built and cached before the first run). Accuracy is greedy, on
the task's 256 held-out problems (products of numbers of up to three digits):

- *with the tool*: whole conversations, the model's calls answered by ``tba.tasks.calculator``;
- *without*: the same model and prompts with no tool (``--task.tools=[]``): its first reply is
  its answer, as if it multiplied by itself.

The slow-tool part trains the same steps in both runtimes, at each ``--workers`` (threads that run
one turn's tool calls at once), with ``benchmarks/fixtures/slow_tools.py:calculator`` (each
call sleeps 0.2 s): the sync runtime waits for the tools, then trains; the ray runtime's searcher
waits for them while the trainer trains. Printed: wall-clock, trainer steps per second, the ratio.
Results go to ``--out`` (``results.json`` and ``results.md``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness import ROOT, describe_machine, print_machine, tba, train

CONFIG = ROOT / "configs" / "tools.yaml"
SLOW = f"--task.tools=[{ROOT / 'benchmarks' / 'fixtures' / 'slow_tools.py'}:calculator]"


def train_run(out: Path, name: str, runtime: str, steps: int, extra: list[str]) -> dict:
    args = [f"--runtime.type={runtime}", f"--trainer.steps={steps}", "--logging.progress=false", *extra]
    done = train(args, out, name, config=CONFIG)
    summary, train_records = done.summary(), done.steps()
    last = train_records[-1]
    return {
        "name": name,
        "runtime": runtime,
        "steps": steps,
        "wall_s": round(done.wall_s, 1),
        "loop_s": round(last["time_s"] - train_records[0]["time_s"], 1),
        "accuracy_before": summary.get("eval/accuracy_initial"),
        "accuracy_after": summary.get("eval/accuracy_final"),
        "tool_calls": last.get("searcher/tool_calls"),
        "tool_errors": last.get("searcher/tool_errors"),
        "turns_per_conversation": last.get("searcher/turns_per_conversation"),
        "sampled_reward_last10": summary.get("searcher/reward_mean_last10"),
    }


def accuracy(target: str, *extra: str) -> float:
    """Greedy accuracy of ``target`` (a run directory, or the built-in model) on the tool config."""
    with_config = [str(CONFIG)] if not Path(target).is_dir() else []
    out = Path(f"/tmp/tba-bench-tools-eval-{time.time_ns()}.json")
    tba("eval", target, *with_config, "--output", str(out), *extra)
    return json.loads(out.read_text())["metrics"]["eval/accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["accuracy", "slow-tool", "both"], default="both")
    parser.add_argument("--steps", type=int, default=200, help="RL steps of the accuracy part")
    parser.add_argument("--slow-steps", type=int, default=60, help="trainer steps of each slow-tool run")
    parser.add_argument("--searchers", type=int, nargs="+", default=[1, 4], help="ray runs' searcher counts")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[8, 128], help="task.environment_workers: tool calls run at once"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tools"))
    args = parser.parse_args()
    print_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    accuracy("builtin:tiny-tools", "--eval.limit=1")  # builds the model once, before any timed run
    if args.part in ("accuracy", "both"):
        before = {
            "with_tool": accuracy("builtin:tiny-tools"),
            "without_tool": accuracy("builtin:tiny-tools", "--task.tools=[]"),
        }
        print(
            f"warm-started model: {before['with_tool']:.1%} with the calculator, {before['without_tool']:.1%} without"
        )
        rows = []
        for runtime in ("sync", "ray"):
            run = train_run(runs, f"rl-{runtime}", runtime, args.steps, [f"--eval.every={max(1, args.steps // 4)}"])
            run["after_with_tool"] = accuracy(str(runs / run["name"]))
            run["after_without_tool"] = accuracy(str(runs / run["name"]), "--task.tools=[]")
            print(json.dumps(run))
            rows.append(run)
        results["accuracy"] = {"before": before, "runs": rows, "environment": describe_machine()}
    if args.part in ("slow-tool", "both"):
        rows = []
        slow = [SLOW, f"--eval.every={args.slow_steps}", "--eval.limit=32"]
        for workers in args.workers:
            base = None
            for runtime, searchers in [("sync", 1)] + [("ray", n) for n in args.searchers]:
                extra = [*slow, f"--task.environment_workers={workers}"]
                if runtime == "ray":  # searchers waiting on tools need little CPU: they share the trainer's cores
                    extra += [f"--runtime.num_searchers={searchers}", f"--runtime.searcher_cpus={1 / searchers:.3g}"]
                name = f"slow-{runtime}-{searchers}-w{workers}"
                run = train_run(runs, name, runtime, args.slow_steps, extra)
                base = base or run
                run.update(searchers=searchers, workers=workers, ratio=round(base["wall_s"] / run["wall_s"], 2))
                print(json.dumps(run))
                rows.append(run)
        results["slow_tool"] = {"runs": rows, "environment": describe_machine()}
    path.write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = []
    if "accuracy" in results:
        b = results["accuracy"]["before"]
        lines += [
            "| model | with the calculator | without |",
            "|---|---:|---:|",
            f"| warm-started (before RL) | {b['with_tool']:.1%} | {b['without_tool']:.1%} |",
        ]
        for r in results["accuracy"]["runs"]:
            lines.append(
                f"| after {r['steps']} TB steps, {r['runtime']} ({r['wall_s']:.0f} s) | "
                f"{r['after_with_tool']:.1%} | {r['after_without_tool']:.1%} |"
            )
        lines.append("")
    if "slow_tool" in results:
        lines += [
            "| runtime (tool: 0.2 s a call) | searchers | tool threads | steps | wall-clock s | loop s | tool calls "
            "| sync / this |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results["slow_tool"]["runs"]:
            lines.append(
                f"| {r['runtime']} | {r['searchers']} | {r['workers']} | {r['steps']} | {r['wall_s']} | "
                f"{r['loop_s']} | {r['tool_calls'] or 0:.0f} | {r['ratio']}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
