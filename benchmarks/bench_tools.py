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

from harness import ROOT, print_machine, tba, train
from harness.study import Arm, Column, Results, Trial, run_study, table

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


def slow_tool_arms(workers: list[int], searchers: list[int]) -> list[Arm]:
    """At each tool-thread count: sync, then ray with each searcher count."""
    arms = []
    for w in workers:
        for runtime, n in [("sync", 1)] + [("ray", n) for n in searchers]:
            extra = [f"--task.environment_workers={w}"]
            if runtime == "ray":  # searchers waiting on tools need little CPU: they share the trainer's cores
                extra += [f"--runtime.num_searchers={n}", f"--runtime.searcher_cpus={1 / n:.3g}"]
            name = f"slow-{runtime}-{n}-w{w}"
            arms.append(Arm(name, runtime, extra, fields={"name": name, "searchers": n, "workers": w}))
    return arms


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
    environment = print_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    path = args.out / "results.json"
    accuracy("builtin:tiny-tools", "--eval.limit=1")  # builds the model once, before any timed run
    if args.part in ("accuracy", "both"):
        before = {
            "with_tool": accuracy("builtin:tiny-tools"),
            "without_tool": accuracy("builtin:tiny-tools", "--task.tools=[]"),
        }
        print(
            f"warm-started model: {before['with_tool']:.1%} with the calculator, {before['without_tool']:.1%} without"
        )

        def rl(trial: Trial) -> dict:
            run = train_run(
                runs, trial.arm.name, trial.arm.runtime, args.steps, [f"--eval.every={max(1, args.steps // 4)}"]
            )
            run["after_with_tool"] = accuracy(str(runs / run["name"]))
            run["after_without_tool"] = accuracy(str(runs / run["name"]), "--task.tools=[]")
            return run

        arms = [Arm(f"rl-{runtime}", runtime, fields={"name": f"rl-{runtime}"}) for runtime in ("sync", "ray")]
        head = {"before": before, "environment": environment}
        run_study(arms, rl, Results(path, ("name",), section=("accuracy", "runs"), head=head, fresh=True), resume=False)
    if args.part in ("slow-tool", "both"):
        slow = [SLOW, f"--eval.every={args.slow_steps}", "--eval.limit=32"]
        base: dict[int, dict] = {}  # workers -> the sync run at that count

        def slow_run(trial: Trial) -> dict:
            arm = trial.arm
            run = train_run(runs, arm.name, arm.runtime, args.slow_steps, [*slow, *arm.overrides])
            first = base.setdefault(arm.fields["workers"], run)
            run.update(searchers=arm.fields["searchers"], workers=arm.fields["workers"])
            run["ratio"] = round(first["wall_s"] / run["wall_s"], 2)
            return run

        results = Results(path, ("name",), section=("slow_tool", "runs"), head={"environment": environment}, fresh=True)
        run_study(slow_tool_arms(args.workers, args.searchers), slow_run, results, resume=False)
    results = json.loads(path.read_text()) if path.exists() else {}
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


ACCURACY = [
    Column("model", "model", "first", ""),
    Column("with the calculator", "with_tool", "first", ".1%", align="r"),
    Column("without", "without_tool", "first", ".1%", align="r"),
]
SLOW_TOOL = [
    Column("runtime (tool: 0.2 s a call)", "runtime", "first", ""),
    Column("searchers", "searchers", "first", "", align="r"),
    Column("tool threads", "workers", "first", "", align="r"),
    Column("steps", "steps", "first", "", align="r"),
    Column("wall-clock s", "wall_s", "first", "", align="r"),
    Column("loop s", "loop_s", "first", "", align="r"),
    Column("tool calls", lambda r: r["tool_calls"] or 0, "first", ".0f", align="r"),
    Column("sync / this", lambda r: f"{r['ratio']}x", "first", "", align="r"),
]


def markdown(results: dict) -> str:
    lines = []
    if "accuracy" in results:
        b = results["accuracy"]["before"]
        rows = [{"model": "warm-started (before RL)", **b}]
        for r in results["accuracy"]["runs"]:
            model = f"after {r['steps']} TB steps, {r['runtime']} ({r['wall_s']:.0f} s)"
            rows.append({"model": model, "with_tool": r["after_with_tool"], "without_tool": r["after_without_tool"]})
        lines += [table(rows, ("model",), ACCURACY), ""]
    if "slow_tool" in results:
        lines.append(table(results["slow_tool"]["runs"], ("name",), SLOW_TOOL))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
