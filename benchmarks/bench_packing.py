"""Packed against padded trainer steps: step time, tokens per second, padding fraction and peak
memory of the same step on the same batch, each mode in a fresh process, side by side in one run.

    .venv/bin/python benchmarks/bench_packing.py --rounds 2       # both models, both length mixes (~6 min)
    .venv/bin/python benchmarks/bench_packing.py --rounds 2 --budget 4096 --out benchmarks/results/packing/budget
    .venv/bin/python benchmarks/bench_packing.py --models tiny30m --data gsm8k
    .venv/bin/python benchmarks/bench_packing.py --quick          # the demo model, a smoke run (~30 s)
    python benchmarks/bench_packing.py --device cuda --models tiny30m --groups 16 --group-size 8

Models (random weights: a step's cost does not depend on them):

- ``tiny30m``: a Llama of 29.9M parameters (hidden 512, 8 layers, 8 heads, intermediate 1408,
  the 8,192-token character vocabulary), ``bench_streaming.py --model tiny30m``'s;
- ``demo``: the built-in demo's shape (hidden 128, 4 layers, 4 heads, intermediate 384, the
  character vocabulary).

Length mixes (``--data``):

- ``gsm8k``: GSM8K-like, prompts uniform over 60-250 tokens, completions log-uniform over 20-500
  (most end with EOS; those drawn at the top are cut there, unfinished), random token ids;
- ``chains``: the worked-chain task (``--task.terms=5 --task.digits=1 --task.show_work=true``):
  its prompts and worked solutions through the character tokenizer, each solution ending with EOS
  and one in each group cut at a random point (an unfinished sample). Short and alike: little
  padding to remove, which is the point of the row.

Each (model, mix) takes ``--groups`` groups of ``--group-size`` completions (one batch, the same in
both modes) and the trainer's defaults with trajectory balance: the whole batch in one forward and
backward pass, so both modes compute the same sequences together and the difference is packing
alone. ``--budget N`` sets ``trainer.micro_batch_tokens`` = N in both modes: it bounds the positions a
pass computes, padding included, and packed passes waste fewer of them, so they hold more groups
(and can take more memory than padded ones that leave part of the budget unused). Packed rows are
``trainer.packing_row_tokens`` (``--row``; ``auto``: as wide as the longest sequence with SDPA).

Per process: build the model (seed 0), take one warm-up step (the AdamW state; its loss and
gradient norm must equal the other mode's within fp32 reordering, so both do the same work), then
``--repeats`` timed steps. Peak memory: the resident set's peak during a step over its size before
(``VmHWM`` reset; CUDA: ``max_memory_allocated`` over what was allocated). Step seconds: the mean of
the timed steps, and the fastest. tokens/s: real tokens (prompt and completion of every sample)
per second of a step. Results: a markdown table on stdout and ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
from pathlib import Path

import torch
import transformers
from harness import describe_machine, print_machine
from harness.measure import fresh_row, timed_steps

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.models.precision import Precision
from tba.models.tiny import DEFAULT_SPEC, TinySpec, build_char_tokenizer, build_tiny_llama
from tba.plan.auto import tb_trust_region
from tba.trainer import Trainer
from tba.types import Batch, Rollout
from tba.weights import LocalWeightStore

MODELS = {  # name: (vocabulary of the character tokenizer, shape)
    "tiny30m": (8192, TinySpec(hidden_size=512, layers=8, heads=8, intermediate_size=1408, max_positions=1024)),
    "demo": (None, TinySpec(**{**DEFAULT_SPEC.__dict__, "max_positions": 1024})),
}
MODES = ("padded", "packed")
RTOL = 1e-4  # equal-work check: fp32 in both modes, sums in another order
QUICK = {"models": ["demo"], "data": ["gsm8k", "chains"], "groups": 2, "group_size": 4, "repeats": 1, "budget": 2048}


def make_batch(data: str, tokenizer, groups: int, k: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    vocab = [i for i in range(len(tokenizer)) if i not in (tokenizer.pad_token_id, eos)]
    prompts, rollouts = [], []
    if data == "chains":
        from tba.tasks.arithmetic import ArithmeticTask

        task = ArithmeticTask(terms=5, digits=1, show_work=True)
        chosen = task.sample_prompts(groups, rng)
    for g in range(groups):
        samples = []
        if data == "gsm8k":
            prompt = [rng.choice(vocab) for _ in range(rng.randint(60, 250))]
            for _ in range(k):
                n = int(math.exp(rng.uniform(math.log(20), math.log(500))))
                finished = n < 480
                samples.append(
                    ([rng.choice(vocab) for _ in range(n - 1)] + ([eos] if finished else [rng.choice(vocab)]), finished)
                )
        elif data == "chains":
            p = chosen[g]
            prompt = tokenizer(p.text, add_special_tokens=False)["input_ids"]
            solution = tokenizer(task.target(p), add_special_tokens=False)["input_ids"]
            for j in range(k):
                if j == 0:  # cut at the limit, unfinished
                    samples.append((solution[: rng.randint(1, len(solution))], False))
                else:
                    samples.append((solution + [eos], True))
        else:
            raise ValueError(f"unknown length mix {data!r}: gsm8k or chains")
        prompts.append(prompt)
        for tokens, finished in samples:
            rollouts.append(
                Rollout(
                    prompt_id=f"p{g}",
                    completion=tuple(tokens),
                    reward=rng.uniform(-2.0, 0.0),  # a log-reward
                    ref_logp=-len(tokens) * math.log(len(vocab)) + rng.gauss(0.0, 1.0),
                    policy_version=0,
                    arrival_step=0,
                    finished=finished,
                )
            )
    return Batch(prompt_ids=prompts, rollouts=rollouts, group_size=k)


def measure(model_name: str, data: str, mode: str, a: argparse.Namespace) -> dict:
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    vocab, spec = MODELS[model_name]
    tokenizer = build_char_tokenizer(vocab)
    torch.manual_seed(0)
    model = build_tiny_llama(tokenizer, spec).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    cfg = TrainerConfig(
        warmup_steps=0,
        sync_interval=10**6,  # no publication inside the measured steps
        micro_batch_tokens=a.budget,
        packing=mode == "packed",
        packing_row_tokens=a.row,
    )
    trainer = Trainer(
        model,
        ReplayBuffer(),
        LocalWeightStore(),
        cfg,
        ObjectiveConfig(),
        a.group_size,
        tokenizer.pad_token_id,
        {tokenizer.eos_token_id},
        precision=Precision("fp32", device.type),
        trust_region=tb_trust_region(ObjectiveConfig()),  # the default band, as a ray run resolves it
    )
    if trainer.passes.packed != (mode == "packed"):
        raise RuntimeError(f"{mode}: the trainer chose {'packed' if trainer.passes.packed else 'padded'} passes")
    batch = make_batch(data, tokenizer, a.groups, a.group_size)
    tokens = sum(len(batch.prompt_ids[g]) + len(r.completion) for g in range(batch.num_groups) for r in batch.group(g))
    first = trainer.step(batch)
    seconds, peaks = timed_steps(trainer, batch, device, a.repeats)
    mean_s = sum(seconds) / len(seconds)
    return {
        "model": model_name,
        "parameters": params,
        "data": data,
        "mode": mode,
        "sequences": len(batch.rollouts),
        "tokens": tokens,
        "micro_batches": int(first["train/micro_batches"]),
        "padding_fraction": first["train/padding_fraction"],
        "step_s": mean_s,
        "step_s_min": min(seconds),
        "steps_s": seconds,
        "tokens_per_s": tokens / mean_s,
        "peak_mib": max(peaks) / 2**20,
        "loss": first["train/loss"],
        "grad_norm": first["train/grad_norm"],
    }


def run_one(model_name: str, data: str, mode: str, a: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh interpreter (:func:`harness.measure.fresh_row`)."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        model_name,
        data,
        mode,
        "--groups",
        a.groups,
        "--group-size",
        a.group_size,
    ]
    cmd += ["--threads", a.threads, "--repeats", a.repeats, "--budget", str(a.budget), "--device", a.device]
    cmd += ["--row", a.row]
    return fresh_row(cmd, f"{model_name} {data} {mode}")


def check_equal_work(padded: dict, packed: dict) -> None:
    for key in ("loss", "grad_norm"):
        diff = abs(packed[key] - padded[key]) / max(abs(padded[key]), 1e-12)
        packed[f"{key}_rel_diff"] = diff
        if diff > RTOL:
            raise AssertionError(
                f"{packed['model']} {packed['data']}: packed {key} {packed[key]:.6g} against padded "
                f"{padded[key]:.6g} (relative difference {diff:.2g}): not the same step"
            )


def table(rows: list[dict]) -> str:
    lines = [
        "| model | lengths | mode | micro-batches | padding | step s (fastest) | tokens/s | peak MiB | speedup "
        "| peak / padded |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['data']} | {r['mode']} | {r['micro_batches']} | {r['padding_fraction']:.0%} | "
            f"{r['step_s']:.2f} ({r['step_s_min']:.2f}) | {r['tokens_per_s']:,.0f} | {r['peak_mib']:,.0f} | "
            f"{r['speedup']:.2f}x | {r['peak_ratio']:.2f} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny30m", "demo"], choices=sorted(MODELS))
    parser.add_argument("--data", nargs="+", default=["gsm8k", "chains"], choices=["gsm8k", "chains"])
    parser.add_argument("--groups", type=int, default=4, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (K)")
    parser.add_argument(
        "--budget",
        type=lambda v: None if v.lower() == "none" else int(v),
        default=None,
        help="trainer.micro_batch_tokens in both modes (default none: the whole batch in one pass)",
    )
    parser.add_argument(
        "--row",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="trainer.packing_row_tokens of the packed mode (auto: as wide as the longest sequence with SDPA)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every measured process")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per mode after the warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="padded then packed, this many times (rows averaged)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder of results.json (default benchmarks/results/packing)"
    )
    parser.add_argument("--quick", action="store_true", help="the demo model, small batches: a smoke run")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "DATA", "MODE"), help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    a = parser.parse_args()
    if a.out is None and not a.quick:
        a.out = Path("benchmarks/results/packing")
    return a


def average(runs: list[dict]) -> dict:
    """One row of several rounds of one mode: times averaged, memory the largest."""
    row = dict(runs[0])
    row["steps_s"] = [s for r in runs for s in r["steps_s"]]
    row["step_s"] = sum(row["steps_s"]) / len(row["steps_s"])
    row["step_s_min"] = min(row["steps_s"])
    row["tokens_per_s"] = row["tokens"] / row["step_s"]
    row["peak_mib"] = max(r["peak_mib"] for r in runs)
    return row


def main() -> None:
    a = parse_args()
    if a.one:
        print(json.dumps(measure(*a.one, a)))
        return
    print_machine()
    print(
        f"batch: {a.groups} groups x {a.group_size} completions; micro_batch_tokens={a.budget}; {a.threads} torch "
        f"threads; {a.repeats} timed step(s) per process, {a.rounds} round(s); each mode in a fresh process",
        flush=True,
    )
    rows = []
    for model_name in a.models:
        for data in a.data:
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for _ in range(a.rounds):  # alternating, so drift of the machine falls on both
                for mode in MODES:
                    r = run_one(model_name, data, mode, a)
                    runs[mode].append(r)
                    print(f"  {model_name} {data} {mode}: {r['step_s']:.2f} s, {r['peak_mib']:.0f} MiB", flush=True)
            padded, packed = average(runs["padded"]), average(runs["packed"])
            check_equal_work(padded, packed)
            for r in (padded, packed):
                r["speedup"] = padded["step_s"] / r["step_s"]
                r["peak_ratio"] = r["peak_mib"] / padded["peak_mib"] if padded["peak_mib"] > 0 else float("nan")
            rows += [padded, packed]
    print(table(rows))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": a.device,
            "budget": a.budget,
            "row": a.row,
            "argv": sys.argv[1:],
        }
        (a.out / "results.json").write_text(
            json.dumps({"machine": meta, "environment": describe_machine(), "rows": rows}, indent=1)
        )
        print(f"results: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
