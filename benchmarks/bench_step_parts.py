"""Where a demo step's time goes, on 1 and on 2 torch threads, and the async speedup it allows.

    .venv/bin/python benchmarks/bench_step_parts.py [--repeats 30] [--tba.overrides ...]

Times a trainer step (sample from the buffer, forward and backward, AdamW) and a searcher batch
(generate K completions per prompt, score, reference log-probs) in one process, alternating the
thread count so both see the same machine state. On C cores the sync runtime pays
train(C threads) + generate(C threads) per step; the async runtime with one searcher on S cores
pays at best max(train(C - S threads), generate(S threads)). The ratio is the upper bound on the
async speedup at equal trainer steps on this machine.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from harness import print_machine
from harness.measure import fill_buffer, sync_components, timed_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args, overrides = parser.parse_known_args()
    print_machine()
    cfg, c = sync_components(None, overrides)
    fill_buffer(c, 5)
    times = {(part, n): [] for part in ("train", "generate") for n in (1, 2)}
    for i in range(2 * args.repeats):
        n = 1 + i % 2
        torch.set_num_threads(n)
        step = timed_round(c)
        times["generate", n].append(step.batch_s)
        times["train", n].append(step.train_s)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(
        f"batch: {cfg.trainer.batch_prompts} prompts x {cfg.generation.group_size} completions; "
        f"median of {args.repeats} per cell"
    )
    print("| part | 1 thread s | 2 threads s | 2-thread speedup |")
    print("|---|---:|---:|---:|")
    for part in ("train", "generate"):
        print(f"| {part} | {med[part, 1]:.4f} | {med[part, 2]:.4f} | {med[part, 1] / med[part, 2]:.2f}x |")
    sync = med["train", 2] + med["generate", 2]
    bound = sync / max(med["train", 1], med["generate", 1])
    print(
        f"sync step on 2 threads: {sync:.4f} s; async step at best (1 + 1 threads): "
        f"{max(med['train', 1], med['generate', 1]):.4f} s; async speedup bound on 2 cores: {bound:.2f}x"
    )


if __name__ == "__main__":
    main()
