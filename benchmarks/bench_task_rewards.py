"""What a searcher's reward costs, per task: the parts of one searcher batch as shares of its time.

    .venv/bin/python benchmarks/bench_task_rewards.py                   # tiny models, 10 batches per task
    .venv/bin/python benchmarks/bench_task_rewards.py --shape paper --tasks redteam --batches 3
    .venv/bin/python benchmarks/bench_task_rewards.py -- --generation.group_size=32   # overrides for every task

One searcher (built the way a searcher process builds it, one thread) runs each task's recipe batch:

- ``arithmetic``: the built-in demo (16 prompts x 8 completions, a Python reward);
- ``dataset``: ``configs/custom_task.yaml`` (the same model, the example's two reward functions);
- ``tldr``: ``configs/tldr_pythia410m.yaml`` (8 posts x 20 summaries of up to 128 tokens) with a
  local policy, a one-label reward model and a few synthetic posts;
- ``redteam``: ``configs/redteam_gpt2.yaml`` (128 attacks of up to 20 tokens, 5 victim answers of up
  to 30 tokens each, one classifier pass over the 640 answers) with a local attacker, victim and
  classifier.

Each batch's time is split into policy generation, the reward (for tldr: the reward model; for
redteam: the victim's generation and the classifier; the rest of the reward call is "reward, other")
and the reference log-probs; what remains is prompt sampling, tokenising and decoding ("other").

``--shape tiny`` (default) uses the test suite's tiny random models (2 layers, width 32): it shows
how the pipeline's parts scale with batch and sequence sizes, not what real models cost.
``--shape paper`` gives the local random models the depth and width of the paper's models (GPT-2
small for attacker and victim, RoBERTa-base for the classifier, Pythia-410m for the TL;DR policy and
reward model) with a small vocabulary: closer to the real cost, slow on a CPU (minutes per batch
for tldr). Nothing is downloaded either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness import ROOT, describe_machine, print_machine

PAPER = {  # depth and width of the paper's models (their vocabularies are not reproduced)
    "gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12},
    "roberta-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "pythia-410m": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
    },
}
PARTS = ("generate", "reward model", "victim", "classifier", "reward, other", "reference", "other")


def task_overrides(task: str, shape: str, root: Path) -> tuple[Path | None, list[str]]:
    """(config file, overrides) for a task's recipe on local models."""
    from tests.helpers.tiny_bpe import build_bpe_chat_model, build_reward_model
    from tests.helpers.tiny_redteam import build_classifier, build_gpt2

    paper = shape == "paper"
    if task == "arithmetic":
        return None, []
    if task == "dataset":
        return ROOT / "configs/custom_task.yaml", []
    if task == "tldr":
        data = root / "tldr-data"
        data.mkdir()
        for split, n in (("train", 64), ("validation", 8)):
            with (data / f"{split}.jsonl").open("w") as f:
                for i in range(n):
                    post = (
                        f"SUBREDDIT: r/tifu\n\nTITLE: I lost {i} clips\n\nPOST: Natalia sold {i} clips to her "
                        f"friends in April, and then she sold half as many clips in May.\n\nTL;DR:"
                    )
                    f.write(json.dumps({"query": post, "reference_response": " she sold clips"}) + "\n")
        size = PAPER["pythia-410m"] if paper else None
        policy = build_bpe_chat_model(root / "policy", shape=size)
        reward_model = build_reward_model(root / "reward-model", shape=size)
        return ROOT / "configs/tldr_pythia410m.yaml", [
            f"--model.policy={policy}",
            "--model.chat_template=false",
            "--model.dtype=float32",
            f"--task.path={data}",
            f"--task.reward_model={reward_model}",
            "--task.judge=null",
        ]
    if task == "redteam":
        gpt2 = PAPER["gpt2"] if paper else None
        attacker = build_gpt2(root / "attacker", seed=0, shape=gpt2)
        victim = build_gpt2(root / "victim", seed=2, shape=gpt2)
        classifier = build_classifier(root / "classifier", seed=3, shape=PAPER["roberta-base"] if paper else None)
        return ROOT / "configs/redteam_gpt2.yaml", [
            f"--model.policy={attacker}",
            "--model.eos_tokens=[]",
            "--model.dtype=float32",
            f"--task.victim={victim}",
            f"--task.classifier={classifier}",
            "--task.dtype=float32",
        ]
    raise ValueError(f"unknown task {task!r}")


class Timer:
    """Wraps bound methods and adds their seconds to named parts (nested parts are subtracted from
    the part that encloses them, so the parts add up to the whole)."""

    def __init__(self):
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.stack: list[str] = []

    def wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            self.stack.append(part)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.stack.pop()
                self.spent[part] += dt
                if self.stack:
                    self.spent[self.stack[-1]] -= dt

        setattr(obj, attr, wrapper)

    def reset(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)


def bench_task(task_name: str, shape: str, batches: int, extra: list[str]) -> dict:
    import torch

    from tba.config import absolute_paths, load_config
    from tba.plan import make_plan
    from tba.runtime.build import build_searcher
    from tba.runtime.components import SearcherSections
    from tba.runtime.preflight import check_models, prepare_task
    from tba.weights import LocalWeightStore

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config, overrides = task_overrides(task_name, shape, Path(tmp))
        cfg = absolute_paths(load_config(config, [*overrides, *extra]))
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
        timer = Timer()
        task = searcher.task
        timer.wrap(searcher.generator, "generate", "generate")
        timer.wrap(task, "rewards", "reward, other")
        timer.wrap(searcher, "_with_ref_logps", "reference")
        if getattr(task, "_scorer", None) is not None:
            timer.wrap(task._scorer, "score", "reward model")
        if task_name == "redteam":
            timer.wrap(task.victim, "answer", "victim")
            timer.wrap(task.classifier, "toxic_logps", "classifier")
        searcher.step()  # warm-up
        timer.reset()
        steps, completions = [], 0
        for _ in range(batches):
            t0 = time.perf_counter()
            groups = searcher.step()
            steps.append(time.perf_counter() - t0)
            completions += sum(len(g.completions) for g in groups)
        total = sum(steps)
        spent = dict(timer.spent)
        spent["other"] = total - sum(v for k, v in spent.items() if k != "other")
        shares = {k: v / total for k, v in spent.items()}
        reward_share = sum(shares[k] for k in ("reward model", "victim", "classifier", "reward, other"))
        params = sum(p.numel() for p in searcher.generator.model.parameters()) / 1e6
        line = ", ".join(f"{k} {shares[k]:.1%}" for k in PARTS if spent[k] > 0 or k in ("generate", "reference"))
        print(
            f"  {task_name:10s} ({params:.3g} M-parameter policy): batch {statistics.median(steps):.2f} s "
            f"(median of {batches}, {completions / batches:.0f} completions kept); {line}; "
            f"reward in all {reward_share:.1%}"
        )
        return {"task": task_name, "batch_s": statistics.median(steps), "shares": shares, "reward_share": reward_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["arithmetic", "dataset", "tldr", "redteam"])
    parser.add_argument("--shape", choices=["tiny", "paper"], default="tiny")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every task, after --")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print_machine()
    print(f"searcher batch parts as shares of its time ({args.shape} models, one thread, {args.batches} batches)")
    results = [bench_task(t, args.shape, args.batches, args.overrides) for t in args.tasks]
    if args.json:
        args.json.write_text(json.dumps({"environment": describe_machine(), "tasks": results}, indent=2))


if __name__ == "__main__":
    main()
