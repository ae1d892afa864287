"""Replay buffer throughput: insert rate while filling, and ``sample(64, 8)`` latency.

    python benchmarks/bench_buffer.py [--sizes 1e3 1e5 1e6]

For each size the buffer (capacity = size, 100 rollouts per prompt) is filled with groups of 8
distinct completions of about 12 random tokens, 20% past capacity so that eviction is part of the
insert cost; ``mark_sync`` is called at 90% so the recent path has prompts to draw from. Then
``sample(64, 8)`` is timed with recent_prob 0.5 and reward_inv_temp 1.0, on the full buffer and
again with 64 new groups added (untimed) before each call. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time

import numpy as np
from harness import print_machine, rule

from tba.buffer import ReplayBuffer
from tba.types import RolloutGroup

GROUP_SIZE = 8
CHUNK_GROUPS = 2_000  # groups generated per chunk: bounds the memory of the not-yet-added data


def make_groups(
    rng: np.random.Generator, first: int, num_groups: int, num_prompts: int, step: int
) -> list[RolloutGroup]:
    # prompts in round-robin order, so every prompt stays in the buffer once it is full
    prompts = np.arange(first, first + num_groups) % num_prompts
    lengths = rng.integers(10, 15, size=(num_groups, GROUP_SIZE))
    tokens = rng.integers(0, 50_000, size=(num_groups, GROUP_SIZE, 14)).tolist()
    rewards = rng.normal(size=(num_groups, GROUP_SIZE)).tolist()
    return [
        RolloutGroup(
            prompt_id=f"prompt-{p}",
            prompt_ids=[int(p), 1, 2, 3],
            completions=[t[:n] for t, n in zip(tokens[g], lengths[g].tolist(), strict=True)],
            rewards=rewards[g],
            ref_logps=[-10.0] * GROUP_SIZE,
            policy_version=step,
            sampler_logps=[-9.0] * GROUP_SIZE,
        )
        for g, p in enumerate(prompts.tolist())
    ]


def num_prompts_for(size: int) -> int:
    # ~100 rollouts per prompt once full: the per-prompt cap, the most work per weighted draw
    return max(64, size // 100)


def fill(buffer: ReplayBuffer, size: int, rng: np.random.Generator) -> tuple[float, int]:
    """Insert 1.2 * size rollouts; return (rollouts per second, groups inserted)."""
    num_prompts = num_prompts_for(size)
    total_groups = max(1, int(1.2 * size) // GROUP_SIZE)
    sync_at = int(0.9 * total_groups)
    seconds, added, step = 0.0, 0, 0
    while added < total_groups:
        groups = make_groups(rng, added, min(CHUNK_GROUPS, total_groups - added), num_prompts, step)
        start = time.perf_counter()
        for group in groups:
            if added == sync_at:
                buffer.mark_sync()
            buffer.add(group, step)
            added += 1
        seconds += time.perf_counter() - start
        step += 1
    return added * GROUP_SIZE / seconds, added


def time_sampling(
    buffer: ReplayBuffer, calls: int, feed: list[list[RolloutGroup]] | None = None
) -> tuple[float, float, float]:
    """Median and p95 of ``sample(64, 8)`` in ms, and the mean recent fraction.

    With ``feed``, one list of groups is added (untimed) before each call, as a trainer drains its
    queue between steps: the prompts they touch must be re-read by the next weighted draw.
    """
    times, recent = [], []
    for i in range(calls):
        for group in feed[i] if feed else []:
            buffer.add(group, step=i)
        start = time.perf_counter()
        batch = buffer.sample(64, GROUP_SIZE)
        times.append((time.perf_counter() - start) * 1e3)
        recent.append(batch.stats["buffer/recent_fraction"])
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))], statistics.mean(recent)


def peak_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e5, 1e6])
    parser.add_argument("--calls", type=int, default=200, help="sample() calls timed per size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print_machine()
    print(
        "| capacity (rollouts) | prompts | insert (rollouts/s) | sample(64, 8) median ms | p95 ms "
        "| recent fraction | with 64 new groups per call: median ms | p95 ms | peak RSS MiB |"
    )
    print(rule("r" * 9))
    for size in sorted(int(s) for s in args.sizes):  # ascending: peak RSS then tracks each size
        rng = np.random.default_rng(args.seed)
        buffer = ReplayBuffer(
            capacity=size, per_prompt_capacity=100, recent_prob=0.5, reward_inv_temp=1.0, seed=args.seed
        )
        rate, added = fill(buffer, size, rng)
        assert len(buffer) == size, "the fill must reach capacity"
        median, p95, recent = time_sampling(buffer, args.calls)
        feed = [make_groups(rng, added + 64 * i, 64, num_prompts_for(size), step=10**6) for i in range(args.calls)]
        fed_median, fed_p95, _ = time_sampling(buffer, args.calls, feed)
        print(
            f"| {size:,} | {buffer.num_prompts:,} | {rate:,.0f} | {median:.2f} | {p95:.2f} | "
            f"{recent:.2f} | {fed_median:.2f} | {fed_p95:.2f} | {peak_rss_mib():,.0f} |",
            flush=True,
        )
        del buffer, feed
        gc.collect()


if __name__ == "__main__":
    main()
