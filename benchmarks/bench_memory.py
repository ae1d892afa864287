"""Peak memory and time of one trainer step: the old log-prob computation against the lean one,
with and without activation checkpointing and token-budget micro-batches, on the CPU (or a CUDA
device, ``--device cuda``: CUDA's peak allocated bytes instead of the resident size).

    .venv/bin/python benchmarks/bench_memory.py              # vocab 8192 and 32768, completions 64 and 256
    .venv/bin/python benchmarks/bench_memory.py --no-bf16    # without the bf16-mixed rows
    .venv/bin/python benchmarks/bench_memory.py --quick      # one tiny setting, a smoke run (about 30 s)
    python benchmarks/bench_memory.py --device cuda --vocab 32768 151936 --lengths 256 1024 --hidden 896 --layers 24

Model: a random Qwen2 (hidden 64, intermediate 128, 2 layers, 2 heads, 1 KV head, untied
embeddings) at each vocabulary size. Batch: ``--groups`` groups of ``--group-size`` completions of
random token ids after a prompt of ``--prompt-len`` tokens; in each group one completion has the
full ``--lengths`` value and the others are between half of it and all of it (the shorter ones end
with EOS). Objective: trajectory balance with the default β. The model is narrow beside its
vocabulary (vocab / hidden = 128 and 512; Qwen2.5-0.5B has 169), so, as in small real policies,
the logits are most of a step's activation memory.

Variants, each in a fresh process (so no variant inherits another's heap):

- ``old``: the trainer computing log-probs as it did before (``full_logits_token_logprobs``: logits
  of every position, an fp32 copy of the completion part, a full ``log_softmax``), one pass;
- ``lean``: the trainer as it is (``token_logprobs``: the output head applied to completion
  positions only, a chunk at a time, each chunk's logits recomputed in the backward pass);
- ``+ckpt``: activation checkpointing of every decoder layer (``enable_gradient_checkpointing``);
- ``+tokens``: ``trainer.micro_batch_tokens`` at a quarter of the batch's padded tokens (4
  micro-batches of whole groups with the default 4 groups);
- ``lean bf16-mixed``: lean under bfloat16 autocast (``trainer.precision=bf16-mixed``). Its time on
  a CPU says nothing about GPUs; the row is there for its memory.

Per process: build model (seed 0), trainer and batch, take one warm-up step (it allocates the AdamW
state, and its loss and gradient norm, from identical weights in every variant, are checked to be
equal across variants, so all rows do the same work), then ``--repeats`` timed steps. A step's
peak is the peak resident set size during the step (``VmHWM``, reset before it) minus the resident
size just before it; the fastest step's seconds and the largest step's peak are reported. Weight
publication is left out (``sync_interval`` is never reached): it is the same in every variant.

Results: a markdown table on stdout and ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import sys
from pathlib import Path

import torch
import transformers
from harness import describe_machine, print_machine
from harness.measure import fresh_row, timed_steps
from tests.helpers.direct_logprobs import full_logits_token_logprobs  # the direct log-probs live with the tests
from transformers import Qwen2Config, Qwen2ForCausalLM

import tba.models.packing
from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.models.precision import Precision
from tba.plan.auto import tb_trust_region
from tba.runtime.policy import enable_gradient_checkpointing
from tba.trainer import Trainer
from tba.types import Batch, Rollout
from tba.weights import LocalWeightStore

VARIANTS = {  # name: (old log-probs, checkpointing, token budget, precision)
    "old": (True, False, False, "fp32"),
    "lean": (False, False, False, "fp32"),
    "lean+ckpt": (False, True, False, "fp32"),
    "lean+tokens": (False, False, True, "fp32"),
    "lean+ckpt+tokens": (False, True, True, "fp32"),
    "lean bf16-mixed": (False, False, False, "bf16-mixed"),
}
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
PAD, EOS = 0, 1  # random completion tokens are drawn above these, so none ends early by chance
RTOL = {"fp32": 1e-4, "bf16-mixed": 1e-2}  # equal-work check: bf16 keeps 8 significant bits
# A smoke run: one small setting, one thread (it must not fight whatever else the machine runs).
QUICK = {"vocab": [2048], "lengths": [16], "prompt_len": 8, "group_size": 4, "threads": 1, "repeats": 1}


# ------------------------------------------------------------------------------------------------
# One (setting, variant), in its own process


def build_model(vocab: int, max_len: int, hidden: int, layers: int) -> torch.nn.Module:
    shape = {**SHAPE, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers}
    config = Qwen2Config(
        vocab_size=vocab,
        **shape,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)  # the same weights in every variant: the equal-work check needs them
    return Qwen2ForCausalLM(config).train()  # train mode: checkpointing only acts in it


def make_batch(vocab: int, prompt_len: int, length: int, groups: int, k: int, seed: int = 0) -> Batch:
    """``groups`` groups of ``k`` random completions; the first of each has ``length`` tokens and
    is unfinished (cut at the limit), the others are shorter and end with EOS."""
    rng = random.Random(seed)
    prompts, rollouts = [], []
    for g in range(groups):
        prompts.append([rng.randrange(2, vocab) for _ in range(prompt_len)])
        for j in range(k):
            n = length if j == 0 else rng.randint(max(1, length // 2), length)
            tokens = [rng.randrange(2, vocab) for _ in range(n)]
            finished = j > 0
            if finished:
                tokens[-1] = EOS
            rollouts.append(
                Rollout(
                    prompt_id=f"p{g}",
                    completion=tuple(tokens),
                    reward=rng.uniform(-2.0, 0.0),  # a log-reward
                    ref_logp=-n * math.log(vocab) + rng.gauss(0.0, 1.0),  # about what a random model gives
                    policy_version=0,
                    arrival_step=0,
                    finished=finished,
                )
            )
    return Batch(prompt_ids=prompts, rollouts=rollouts, group_size=k)


def token_budget(prompt_len: int, length: int, groups: int, k: int) -> int:
    """A quarter of the batch's padded tokens, rounded up to whole groups: every group holds one
    completion of the full length, so each micro-batch is ceil(groups / 4) groups."""
    return math.ceil(groups / 4) * k * (prompt_len + length)


def make_trainer(model: torch.nn.Module, variant: str, budget: int, k: int, device: torch.device) -> Trainer:
    _, ckpt, tokens, precision = VARIANTS[variant]
    if ckpt:
        enable_gradient_checkpointing(model)
    cfg = TrainerConfig(
        warmup_steps=0,  # the warm-up step must move the weights like any other
        sync_interval=10**6,  # no publication inside the measured steps
        micro_batch_tokens=budget if tokens else None,
        packing=False,  # the padded passes these rows were measured with (packing: bench_packing.py)
        gradient_checkpointing=ckpt,
        precision=precision,
    )
    return Trainer(
        model,
        ReplayBuffer(),
        LocalWeightStore(),
        cfg,
        ObjectiveConfig(),
        k,
        PAD,
        {EOS},
        precision=Precision(precision, device.type),
        trust_region=tb_trust_region(ObjectiveConfig()),  # the default band, as a ray run resolves it
    )


def measure(vocab: int, length: int, variant: str, a: argparse.Namespace) -> dict:
    """One row: this process's warm-up step, then the timed steps."""
    torch.set_num_threads(a.threads)
    if VARIANTS[variant][0]:  # a padded pass (tba.models.packing.Passes) looks the name up each time
        tba.models.packing.token_logprobs = full_logits_token_logprobs
    device = torch.device(a.device)
    model = build_model(vocab, a.prompt_len + length + 1, a.hidden, a.layers).to(device)
    budget = token_budget(a.prompt_len, length, a.groups, a.group_size)
    trainer = make_trainer(model, variant, budget, a.group_size, device)
    batch = make_batch(vocab, a.prompt_len, length, a.groups, a.group_size)
    first = trainer.step(batch)  # allocates the AdamW state; the weights are still the seed's
    seconds, peaks = timed_steps(trainer, batch, device, a.repeats)
    return {
        "vocab": vocab,
        "completion_len": length,
        "variant": variant,
        "precision": VARIANTS[variant][3],
        "micro_batches": int(first["train/micro_batches"]),
        "peak_mib": max(peaks) / 2**20,  # memory is a limit: the worse step counts
        "step_s": min(seconds),  # time: the least disturbed step
        "peaks_mib": [p / 2**20 for p in peaks],
        "steps_s": seconds,
        "loss": first["train/loss"],
        "grad_norm": first["train/grad_norm"],
    }


# ------------------------------------------------------------------------------------------------
# The driver


def run_one(vocab: int, length: int, variant: str, a: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh interpreter (:func:`harness.measure.fresh_row`)."""
    sizes = ["--prompt-len", a.prompt_len, "--groups", a.groups, "--group-size", a.group_size]
    cmd = [sys.executable, __file__, "--one", vocab, length, variant, *sizes, "--threads", a.threads]
    shape = ["--device", a.device, "--hidden", a.hidden, "--layers", a.layers]
    return fresh_row([*cmd, "--repeats", a.repeats, *shape], f"{variant} at vocab {vocab}, length {length}")


def check_equal_work(rows: list[dict]) -> None:
    """Every variant of one setting took its first step from the same weights on the same batch:
    its loss and gradient norm must be the old variant's (within the precision's tolerance)."""
    old = next(r for r in rows if r["variant"] == "old")
    for r in rows:
        for key in ("loss", "grad_norm"):
            diff = abs(r[key] - old[key]) / max(abs(old[key]), 1e-12)
            r[f"{key}_rel_diff"] = diff
            if diff > RTOL[r["precision"]]:
                raise AssertionError(
                    f"{r['variant']} at vocab {r['vocab']}, length {r['completion_len']}: {key} {r[key]:.6g} "
                    f"against old {old[key]:.6g} (relative difference {diff:.2g}): not the same step"
                )


def add_ratios(rows: list[dict], a: argparse.Namespace) -> None:
    old = next(r for r in rows if r["variant"] == "old")
    for r in rows:
        r["full_logits_mib"] = full_logits_mib(r["vocab"], r["completion_len"], a)
        r["peak_ratio"] = r["peak_mib"] / old["peak_mib"]
        r["time_ratio"] = r["step_s"] / old["step_s"]


def full_logits_mib(vocab: int, length: int, a: argparse.Namespace) -> float:
    """One fp32 tensor of the batch's logits at every position, for scale."""
    return a.groups * a.group_size * (a.prompt_len + length) * vocab * 4 / 2**20


def table(rows: list[dict]) -> str:
    lines = [
        "| vocab | completion | variant | micro-batches | step peak MiB | step s | peak / old | time / old |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = "" if r["precision"] == "fp32" else " †"
        lines.append(
            f"| {r['vocab']:,} | {r['completion_len']} | {r['variant']}{mark} | {r['micro_batches']} | "
            f"{r['peak_mib']:,.0f} | {r['step_s']:.3f} | {r['peak_ratio']:.2f} | {r['time_ratio']:.2f} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256], help="longest completion, tokens")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (K)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every measured process")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per variant after the warm-up")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the lean bf16-mixed rows")
    parser.add_argument("--device", default="cpu", help="cpu (peak resident memory) or cuda (CUDA's peak allocated)")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden_size"], help="model width (intermediate: 2x)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of results.json (default benchmarks/results/memory; none with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--one", nargs=3, metavar=("VOCAB", "LENGTH", "VARIANT"), help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].quick:  # defaults only: sizes given on the command line still count
        parser.set_defaults(**QUICK)
    a = parser.parse_args()
    if a.out is None and not a.quick:
        a.out = Path("benchmarks/results/memory")
    return a


def main() -> None:
    a = parse_args()
    if a.one:
        vocab, length, variant = a.one
        print(json.dumps(measure(int(vocab), int(length), variant, a)))
        return
    variants = [v for v in VARIANTS if not a.no_bf16 or VARIANTS[v][3] == "fp32"]
    print_machine()
    print(
        f"batch: {a.groups} groups x {a.group_size} completions, prompt {a.prompt_len} tokens; "
        f"{a.threads} torch threads; {a.repeats} timed step(s) per row; each row in a fresh process",
        flush=True,
    )
    rows = []
    for vocab in a.vocab:
        for length in a.lengths:
            setting = []
            for variant in variants:
                setting.append(run_one(vocab, length, variant, a))
                r = setting[-1]
                print(
                    f"  vocab {vocab} length {length} {variant}: {r['peak_mib']:.0f} MiB {r['step_s']:.3f} s",
                    flush=True,
                )
            check_equal_work(setting)
            add_ratios(setting, a)
            rows += setting
    print()
    print(table(rows))
    print()
    for vocab in a.vocab:
        for length in a.lengths:
            mib = full_logits_mib(vocab, length, a)
            print(f"one fp32 logits tensor of the batch at vocab {vocab:,}, length {length}: {mib:,.0f} MiB")
    if not a.no_bf16:
        print("† bf16-mixed on a CPU: its time says nothing about GPUs; the row is there for its memory")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        command = shlex.join([".venv/bin/python", "benchmarks/bench_memory.py", *sys.argv[1:]])
        result = {
            "command": command,
            "machine": machine(),
            "environment": describe_machine(),
            "settings": vars(a) | {"out": str(a.out)},
            "rows": rows,
        }
        (a.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
