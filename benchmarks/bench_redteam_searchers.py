"""Red-teaming with more searchers: attack success rate and diversity against the number of searchers.

The TBA paper reports that more searchers give more successful and more diverse attacks. This runs
the real CLI (``tba train CONFIG --runtime.num_searchers=N``) once per N and prints, per run, the
final evaluation's attack success rate, diversity and toxicity, the wall-clock time and the mean
lag of the trained data.

For a GPU machine with the recipe (the hub models need network access the first time)::

    .venv/bin/python benchmarks/bench_redteam_searchers.py                        # N = 1 2 4, recipe steps
    .venv/bin/python benchmarks/bench_redteam_searchers.py --searchers 1 2 4 --steps 1000
    .venv/bin/python benchmarks/bench_redteam_searchers.py --steps 1000 1800 3000  # one per N

Equal trainer steps is the default (one ``--steps`` value for every run). For an equal wall-clock
comparison, give one ``--steps`` value per searcher count, chosen so that the runs take about the
same time (a first equal-steps run shows each N's seconds per step). Anything after ``--`` is passed
to every run as overrides (``-- --runtime.searcher_gpus=0.25 --eval.every=250``).

CPU smoke version with tiny random local models (tests/helpers/tiny_redteam.py; nothing is downloaded; the
numbers mean nothing, it only shows the pipeline runs)::

    .venv/bin/python benchmarks/bench_redteam_searchers.py --smoke --searchers 1 2

which is the recipe with the models replaced and every size shrunk; ``--config`` with overrides
after ``--`` does the same for your own models.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness import ROOT, describe_machine, fmt, print_machine, row, rule, train

METRICS = ("eval/attack_success_rate", "eval/diversity", "eval/toxicity_mean")


def smoke_overrides(out: Path) -> list[str]:
    """The recipe on tiny local models at CPU sizes."""
    from tests.helpers.tiny_redteam import build_redteam_models
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving five tiny models would print ten bars
    models = build_redteam_models(out / "tiny-models")
    return [
        f"--model.policy={models['attacker']}",
        "--model.eos_tokens=[]",
        f"--task.victim={models['victim']}",
        f"--task.classifier={models['classifier']}",
        f"--task.embedder={models['embedder']}",
        "--task.batch_size=null",
        "--task.victim_samples=2",
        "--task.eval_top=3",
        "--generation.group_size=16",
        "--generation.max_new_tokens=10",
        "--eval.samples=32",
        "--eval.max_new_tokens=10",
        "--eval.every=10",
        "--trainer.checkpoint_every=null",
        "--run.device=cpu",
        "--runtime.searcher_gpus=0",
        "--runtime.searcher_cpus=0.5",  # several searchers fit on a 2-core machine
    ]


def run(config: Path, out: Path, searchers: int, steps: int | None, extra: list[str]) -> dict:
    name = f"searchers{searchers}"
    args = [f"--runtime.num_searchers={searchers}", "--logging.progress=false", *extra]
    if steps is not None:
        args.append(f"--trainer.steps={steps}")
    done = train(args, out, name, config=config)
    summary, records = done.summary(), done.metrics()
    evals = [r for r in records if r.get(METRICS[0]) is not None]
    return {
        "searchers": searchers,
        "steps": summary["trainer_steps"],
        "wall_s": done.wall_s,
        "lag": summary.get("lag_mean"),
        "initial": {m: evals[0].get(m) for m in METRICS},
        "final": {m: evals[-1].get(m) for m in METRICS},
    }


def table(results: list[dict]) -> str:
    lines = [
        "| searchers | steps | wall s | lag | success rate (initial -> final) | diversity | toxicity |",
        rule("r" * 7),
    ]
    for r in results:
        asr = f"{fmt(r['initial'][METRICS[0]], '.1%')} -> {fmt(r['final'][METRICS[0]], '.1%')}"
        lines.append(
            row(
                [
                    r["searchers"],
                    r["steps"],
                    format(r["wall_s"], ".0f"),
                    fmt(r["lag"], ".1f"),
                    asr,
                    fmt(r["final"][METRICS[1]], ".3f"),
                    fmt(r["final"][METRICS[2]], ".3f"),
                ]
            )
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "redteam_gpt2.yaml")
    parser.add_argument("--searchers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, nargs="+", help="one value for all runs, or one per searcher count")
    parser.add_argument("--out", type=Path, default=Path("runs") / f"bench-redteam-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--smoke", action="store_true", help="tiny local models on the CPU (see the docstring)")
    parser.add_argument("overrides", nargs="*", help="after --: overrides for every run")
    a = parser.parse_args()
    steps = a.steps or [None]
    if len(steps) not in (1, len(a.searchers)):
        parser.error(f"--steps takes one value or one per searcher count ({len(a.searchers)}), got {len(steps)}")
    steps = steps * len(a.searchers) if len(steps) == 1 else steps
    print_machine()
    a.out.mkdir(parents=True, exist_ok=True)
    extra = [*smoke_overrides(a.out), "--trainer.steps=20"] if a.smoke else []
    extra += a.overrides
    results = []
    for n, s in zip(a.searchers, steps, strict=True):
        print(f"training with {n} searcher(s)...", flush=True)
        results.append(run(a.config, a.out, n, s, extra))
    print(table(results))
    (a.out / "results.json").write_text(
        json.dumps({"environment": describe_machine(), "runs": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
