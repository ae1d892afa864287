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

from harness import (
    ROOT,
    load_results,
    machine_line,
    outcome,
    parse_with_overrides,
    print_machine,
    results_folder,
    row,
    sampled,
    spread,
    train,
)
from harness.settings import SETTINGS

from tba.config import load_config

ARMS: dict[str, list[str]] = {
    "sync": ["--runtime.type=sync"],
    "auto": [],
    "ray": ["--runtime.type=ray"],
    "ray_t2": ["--runtime.type=ray", "--runtime.trainer_cpus=2"],
    "ray_ahead1": ["--runtime.type=ray", "--runtime.max_ahead=1"],
    "ray_ahead1_t2": ["--runtime.type=ray", "--runtime.max_ahead=1", "--runtime.trainer_cpus=2"],
}


def run(setting: str, arm: str, seed: int, out: Path, extra: list[str]) -> dict:
    metric = "eval/reward" if setting == "real" else "eval/accuracy"
    name = f"{setting}-{arm}-seed{seed}"
    args = [*SETTINGS[setting], *ARMS[arm], f"--run.seed={seed}", "--logging.progress=false", *extra]
    done = train(args, out, name, cwd=ROOT, clear=True)
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
        "seed": seed,
        "runtime": config["runtime"],
        **outcome(summary, metric),
        **sampled(out / name),
        "wall_clock_s": round(done.wall_s, 1),
        "step_s_median": statistics.median(r["train/step_s"] for r in rows) if rows else None,
        "publish_s_median": statistics.median(published) if published else None,
        "made_per_drawn": made / drawn if made and drawn else None,
        "paused_s": last.get("searcher/paused_s"),
        "startup_s": summary.get("startup_s"),
        "command": " ".join(["tba train", *args]),
    }


def report(rows: list[dict], environment: dict | None) -> None:
    print(f"machine: {machine_line(environment)}" if environment else "machine: unknown")
    sync = {(r["setting"], r["seed"]): r["wall_clock_s"] for r in rows if r["arm"] == "sync"}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        print(f"\n### {setting}\n")
        print(
            "| arm | runtime | seeds | wall, s | vs sync | gain | sampled, last 10 | lag | made / drawn "
            "| paused, s | step, s | publish on path, s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for arm in ARMS:
            rs = sorted((r for r in rows if r["setting"] == setting and r["arm"] == arm), key=lambda r: r["seed"])
            if not rs:
                continue

            def present(key, rs=rs):
                """``key``'s values over the seeds that have it."""
                return [r[key] for r in rs if r.get(key) is not None]

            def cell(key, spec):
                """The mean of ``key`` over the seeds that have it, formatted, or "-" where none has."""
                values = present(key)
                return format(statistics.mean(values), spec) if values else "-"

            ratios = [sync[(setting, r["seed"])] / r["wall_clock_s"] for r in rs if (setting, r["seed"]) in sync]
            cells = [
                arm,
                rs[0]["runtime"],
                ",".join(str(r["seed"]) for r in rs),
                cell("wall_clock_s", ".0f"),
                spread(ratios, ".2f", "x"),
                spread(present("gain"), ".3f"),
                spread(present("sampled_last10"), ".3f"),
                cell("lag_mean", ".2f"),
                cell("made_per_drawn", ".2f"),
                cell("paused_s", ".0f"),
                cell("step_s_median", ".2f"),
                cell("publish_s_median", ".3f"),
            ]
            print(row(cells))


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
    kept = load_results(path)
    rows, environment = kept.get("runs", []), kept.get("environment")
    if a.command == "run":
        environment = print_machine()
        for setting in a.settings:
            backend = ["--generation.backend=vllm"] if setting == "real" and a.real_backend == "vllm" else []
            for seed in a.seeds:  # arms side by side at each seed: the machine drifts less between them
                for arm in a.arms:
                    row = run(setting, arm, seed, a.out / "runs", [*backend, *extra])
                    print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
                    rows = [r for r in rows if (r["setting"], r["arm"], r["seed"]) != (setting, arm, seed)]
                    rows.append(row)
                    path.write_text(json.dumps({"environment": environment, "runs": rows}, indent=1) + "\n")
    report(rows, environment)


if __name__ == "__main__":
    main()
