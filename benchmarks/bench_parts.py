"""The parts of a step that the cost model (tba.plan.cost) composes, measured apart on this machine.

    .venv/bin/python benchmarks/bench_parts.py --setting real --threads 1 -- --generation.backend=vllm
    .venv/bin/python benchmarks/bench_parts.py --setting real --threads 2 -- --generation.backend=vllm

One process per thread count (a vLLM engine on a CPU takes its threads when it is built). With the
real components of the sync runtime (the task, the searcher with its generator and reference, the
trainer), alone in the process and one after another, it times:

- a searcher's batch (``Searcher.step``: generation, rewards, reference log-probs), with the
  tokens it generated;
- a trainer step (``Trainer.step`` on a batch from the buffer), with the tokens it trained on;
- the step's publication (``train/publish_s``) and the searcher's load of it (``Searcher.pull_weights``).

Medians of ``--repeats`` after three batches that fill the buffer and two warm-up rounds; the row is merged into
``benchmarks/results/parts/results.json`` under the machine's CPU, the setting and the thread count.
These are parts, not runs: the layouts that compose them are checked in
``benchmarks/validate_cost_model.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from harness import print_machine
from harness.measure import fill_buffer, sync_components, timed_round
from harness.settings import SETTINGS

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "parts" / "results.json"


def measure(setting: str, threads: int, repeats: int, overrides: list[str]) -> dict:
    torch.set_num_threads(threads)  # before the engine is built (vLLM fixes the process's threads)
    args = list(SETTINGS[setting])
    path = args.pop(0) if args and args[0].endswith(".yaml") else None
    cfg, c = sync_components(path, [*args, f"--run.threads={threads}", *overrides])
    params = sum(p.numel() for p in c.policy.parameters())
    c.searcher.pull_weights()
    fill_buffer(c, 3)
    cells: dict[str, list[float]] = {k: [] for k in ("batch_s", "generated", "prompt_tokens", "train_s", "trained")}
    cells.update(publish_s=[], load_s=[])
    for i in range(repeats + 2):
        step = timed_round(c)
        publish_s = step.metrics.get("train/publish_s", 0.0)  # the step publishes (trainer.sync_interval)
        start = time.perf_counter()
        c.searcher.pull_weights()
        load_s = time.perf_counter() - start
        if i < 2:
            continue  # warm-up
        cells["batch_s"].append(step.batch_s)
        cells["generated"].append(sum(len(x) for g in step.groups for x in g.completions))
        cells["prompt_tokens"].append(sum(len(g.prompt_ids) * len(g.completions) for g in step.groups))
        cells["train_s"].append(step.train_s)
        cells["trained"].append(step.metrics.get("train/tokens", 0.0))
        cells["publish_s"].append(publish_s)
        cells["load_s"].append(load_s)
    med = {k: round(statistics.median(v), 4) for k, v in cells.items()}
    return {
        "setting": setting,
        "overrides": overrides,
        "threads": threads,
        "params": params,
        "completions_per_batch": cfg.generation.prompts_per_batch * cfg.generation.group_size,
        "completions_per_step": cfg.trainer.batch_prompts * cfg.generation.group_size,
        "backend": cfg.generation.backend,
        "repeats": repeats,
        **med,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=list(SETTINGS), default="real")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    environment = print_machine()
    row = {"cpu": environment["cpu"], "cores": environment["cores"], "commit": environment.get("commit")}
    row.update(measure(args.setting, args.threads, args.repeats, overrides))
    print(json.dumps(row, indent=1))
    data = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": []}
    key = ("cpu", "setting", "threads", "backend")
    data["rows"] = [r for r in data["rows"] if any(r.get(k) != row[k] for k in key)] + [row]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
