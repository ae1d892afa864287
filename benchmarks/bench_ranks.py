"""Step time and memory per rank of the sharded trainer (``trainer.num_ranks``): 1 rank against 2 on
this machine's CPUs (gloo), the same model, batch and steps.

    .venv/bin/python benchmarks/bench_ranks.py                 # hidden 512, 8 layers (about 25M parameters)
    .venv/bin/python benchmarks/bench_ranks.py --hidden 256 --layers 4 --steps 3   # a quick run

Model: a random Llama (the demo's character tokenizer) of ``--hidden`` / ``--layers``, saved to a
temporary folder that every rank loads. Batch: 16 groups of 8 completions of 24 random tokens
after an 8-token prompt, trajectory balance, fp32. Both settings run through the same code path, a
group of trainer ranks (Ray actors, FSDP2 per decoder layer): with 1 rank nothing is sharded and
FSDP's collectives are no-ops. Three settings: 1 rank on 1 thread, 2 ranks on 1 thread each, and
1 rank on 2 threads (the CPUs that 2 ranks use: what sharding costs in time at equal compute).
Each takes one warm-up step (AdamW allocates its state), then ``--steps`` timed steps.

Per rank: the step's seconds (median), and its memory: the process's peak resident size during
the timed steps minus its resident size before the model was loaded (Python, torch and Ray's
client are the same in both settings). Weights, gradients and AdamW moments are 16 bytes a
parameter in fp32; sharded over 2 ranks each holds half, plus the gathered weights of the decoder
layer being computed (and the root's: embeddings, output head) and the activations of its half of
the batch.

Results: a markdown table on stdout and ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from harness import ROOT, describe_machine, print_machine

from tba.config import load_config
from tba.models.tiny import TinySpec, build_char_tokenizer, build_tiny_llama
from tba.plan import make_plan
from tba.runtime.ranks import RankGroup
from tba.types import Batch, Rollout


def make_batch(vocab: int, eos: int, groups: int = 16, k: int = 8, prompt: int = 8, length: int = 24) -> Batch:
    rng = random.Random(0)
    prompts = [[rng.randrange(4, vocab) for _ in range(prompt)] for _ in range(groups)]
    rollouts = [
        Rollout(
            f"p{g}",
            tuple(rng.randrange(4, vocab) for _ in range(length - 1)) + (eos,),
            float(rng.random() < 0.5),
            -30.0,
            0,
            0,
        )
        for g in range(groups)
        for _ in range(k)
    ]
    return Batch(prompts, rollouts, k)


def run(ranks: int, cpus: int, path: str, steps: int, batch: Batch, pad: int, eos: int) -> dict:
    cfg = load_config(
        None,
        [
            f"--model.policy={path}",
            "--run.device=cpu",
            f"--trainer.num_ranks={ranks}",
            "--trainer.precision=fp32",
            "--trainer.batch_prompts=16",
            f"--runtime.rank_cpus={cpus}",
        ],
    )
    group = RankGroup(
        cfg.model_dump(mode="json"), cfg.trainer, cfg.objective, make_plan(cfg), pad, {eos}, log=lambda m: None
    )
    try:
        group.update(batch, 0)  # warm-up: AdamW allocates its state
        group.memory()
        times, peaks = [], [0.0] * ranks
        for step in range(1, steps + 1):
            start = time.perf_counter()
            metrics = group.update(batch, step)
            times.append(time.perf_counter() - start)
            for r, m in enumerate(group.last_rank_metrics):
                peaks[r] = max(peaks[r], m["rank/peak_memory_gb"])
        memory = group.memory()
        return {
            "ranks": ranks,
            "threads_per_rank": cpus,
            "step_s": statistics.median(times),
            "loss": metrics["train/loss"],
            "peak_gb": peaks,
            "base_gb": [m["base_gb"] for m in memory],
            "held_gb": [p - m["base_gb"] for p, m in zip(peaks, memory, strict=True)],
        }
    finally:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ranks"))
    args = parser.parse_args()
    print_machine()
    tokenizer = build_char_tokenizer()
    spec = TinySpec(
        hidden_size=args.hidden, layers=args.layers, heads=8, intermediate_size=args.hidden * 3, max_positions=64
    )
    torch.manual_seed(0)
    model = build_tiny_llama(tokenizer, spec)
    params = sum(p.numel() for p in model.parameters())
    ray.init(
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        batch = make_batch(len(tokenizer), tokenizer.eos_token_id)
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        # 1 rank on 1 thread, 2 ranks on 1 thread each, and 1 rank on 2 threads (the same CPUs as 2 ranks)
        rows = [run(n, cpus, folder, args.steps, batch, pad, eos) for n, cpus in ((1, 1), (2, 1), (1, 2))]
    ray.shutdown()
    one, two, wide = rows
    assert abs(one["loss"] - two["loss"]) <= 1e-4 * abs(one["loss"]), "the two settings did not train alike"
    state_gb = params * 16 / 2**30
    print(
        f"\n{params / 1e6:.1f}M parameters (weights + gradients + AdamW moments in fp32: {state_gb:.3f} GiB), "
        f"16 groups x 8 completions, {args.steps} timed steps, {os.cpu_count()} CPUs\n"
    )
    print("| ranks | threads per rank | step s (median) | memory held per rank, GiB | peak RSS per rank, GiB |")
    print("|---|---|---|---|---|")
    for row in rows:
        held = ", ".join(f"{v:.3f}" for v in row["held_gb"])
        peak = ", ".join(f"{v:.3f}" for v in row["peak_gb"])
        print(f"| {row['ranks']} | {row['threads_per_rank']} | {row['step_s']:.3f} | {held} | {peak} |")
    ratio_t = two["step_s"] / one["step_s"]
    ratio_m = max(two["held_gb"]) / one["held_gb"][0]
    ratio_w = two["step_s"] / wide["step_s"]
    print(
        f"\n2 ranks / 1 rank: step time {ratio_t:.2f}x (against 1 rank on as many threads: {ratio_w:.2f}x), "
        f"memory held per rank {ratio_m:.2f}x"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "parameters": params,
                "hidden": args.hidden,
                "layers": args.layers,
                "steps": args.steps,
                "cpus": os.cpu_count(),
                "environment": describe_machine(),
                "rows": rows,
                "step_ratio": ratio_t,
                "step_ratio_same_threads": ratio_w,
                "memory_ratio": ratio_m,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
