"""What tasks cost: loading a large dataset, and the searcher's time in task code.

    .venv/bin/python benchmarks/bench_tasks.py                 # 100k rows, 30 searcher batches
    .venv/bin/python benchmarks/bench_tasks.py --rows 20000 --batches 10

1. **Loading**: a JSONL file of ``--rows`` rows (a 150-character prompt, an answer and two
   other columns) loaded by ``task.name: dataset`` through ``datasets``, in a fresh process each
   time: seconds and the process's peak resident memory above what it held after its imports. Once
   without a tokenizer, once with the demo tokenizer and the ``max_prompt_tokens`` filter.
2. **Searcher**: one searcher on the built-in demo model (16 prompts x 8 completions a batch, one
   thread), timing each batch's parts. Task code is prompt sampling plus the reward call (for
   ``dataset``, the user's two reward functions of ``examples/custom_task`` with their argument
   handling). Reported as a share of the whole batch (generate, decode, rewards, reference
   log-probs); the target is under 5%.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, print_machine
from harness.measure import fresh_row

LOAD_SNIPPET = """
import json, sys, time, resource
import tba.tasks
from tba.config import DatasetTaskConfig
cfg = DatasetTaskConfig(path=sys.argv[1], reward_funcs=[sys.argv[2]], eval_size=256, max_prompt_tokens=int(sys.argv[3]))
tok = None
if sys.argv[4] == '1':
    from tba.models.tiny import build_char_tokenizer
    tok = build_char_tokenizer()
import datasets  # imports are not the data's cost
base = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])
t0 = time.perf_counter()
task = tba.tasks.build_task(cfg, tokenizer=tok, log=lambda m: None)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_mb": peak / 1024, "base_mb": base / 1024,
                  "train": task.num_train, "dropped": task.dropped_long}))
"""


def make_jsonl(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(rows):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            filler = "".join(rng.choice("0123456789+-") for _ in range(rng.randint(100, 200)))
            f.write(json.dumps({"prompt": f"{filler}{a}+{b}=", "answer": a + b, "id": i, "source": "synthetic"}) + "\n")


def bench_loading(rows: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        t0 = time.perf_counter()
        make_jsonl(path, rows)
        print(f"wrote {rows:,} rows ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
        spec = f"{ROOT / 'examples/custom_task/rewards.py'}:exact"
        results = []
        for with_tok, limit in ((False, 1024), (True, 1024), (True, 150)):
            cmd = [sys.executable, "-c", LOAD_SNIPPET, str(path), spec, str(limit), "1" if with_tok else "0"]
            # first load builds the datasets cache (Arrow files) for this file; the second reuses it
            for attempt in ("first", "cached"):
                out = fresh_row(cmd, f"loading {rows:,} rows ({attempt})", env={})
                out.update(tokenizer=with_tok, max_prompt_tokens=limit, load=attempt)
                results.append(out)
                print(
                    f"  load ({attempt:6s}) tokenizer={str(with_tok):5s} max_prompt_tokens={limit:5d}: "
                    f"{out['seconds']:.2f} s, peak RSS {out['peak_mb'] - out['base_mb']:+.0f} MB above imports "
                    f"({out['train']:,} training prompts, {out['dropped']:,} dropped as too long)"
                )
        return results


def bench_searcher(batches: int, task_name: str) -> dict:
    import torch

    from tba.config import load_config
    from tba.plan import make_plan
    from tba.runtime.build import build_searcher
    from tba.runtime.components import SearcherSections
    from tba.runtime.preflight import check_models, prepare_task
    from tba.weights import LocalWeightStore

    torch.set_num_threads(1)
    args = ["--trainer.steps=1"] if task_name == "arithmetic" else []
    cfg = load_config(ROOT / "configs/custom_task.yaml" if task_name == "dataset" else None, args)
    from tba.config import absolute_paths

    cfg = absolute_paths(cfg)
    prepare_task(cfg.model, cfg.task, cfg.objective, log=lambda m: None)
    weights = LocalWeightStore()
    plan = make_plan(cfg)
    check_models(cfg.model, cfg.generation, cfg.task, plan, log=lambda m: None)
    searcher = build_searcher(
        SearcherSections(cfg.generation, cfg.trainer, cfg.model, cfg.task, cfg.run.seed),
        plan,
        weights,
        log=lambda m: None,
    )
    weights.publish(searcher.generator.model.state_dict(), 0)
    task = searcher.task
    spent = {"sample": 0.0, "reward": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    task.sample_prompts = timed("sample", task.sample_prompts)
    task.rewards = timed("reward", task.rewards)
    searcher.step()  # warm-up
    spent.update(sample=0.0, reward=0.0)
    steps = []
    for _ in range(batches):
        t0 = time.perf_counter()
        searcher.step()
        steps.append(time.perf_counter() - t0)
    total = sum(steps)
    share = (spent["sample"] + spent["reward"]) / total
    print(
        f"  {task_name:10s}: batch {statistics.median(steps) * 1000:.0f} ms (median of {batches}); "
        f"prompt sampling {spent['sample'] / batches * 1000:.2f} ms, rewards {spent['reward'] / batches * 1000:.2f} ms "
        f"per batch: task code {share:.2%} of the batch"
    )
    return {"task": task_name, "batch_ms": statistics.median(steps) * 1000, "task_share": share, **spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=30)
    args = parser.parse_args()
    print_machine()
    print(f"1. loading a {args.rows:,}-row JSONL through task.name=dataset (fresh process each)")
    bench_loading(args.rows)
    print(f"2. searcher time in task code, demo model, 16 prompts x 8 completions, {args.batches} batches")
    for name in ("arithmetic", "dataset"):
        bench_searcher(args.batches, name)


if __name__ == "__main__":
    main()
