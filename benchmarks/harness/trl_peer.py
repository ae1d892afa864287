"""TRL's ``GRPOTrainer`` on a single-turn tba setting: the peer of ``bench_per_step.py``.

    cd benchmarks && python -m harness.trl_peer OUT SEED [tba train overrides...]

The overrides are read as ``tba train`` reads them (``tba.config.load_config``), and TRL gets the
same model, the same task's training prompts (drawn with ``SEED``), the same reward (the task's own),
the same batch (``generation.prompts_per_batch`` prompts x ``generation.group_size`` completions an
optimizer step), steps, learning rate and schedule, sampling temperature and completion length.
TRL's own GRPO settings stay at its defaults (loss ``dapo``, group-scaled rewards, ε 0.2, one
iteration a batch), with beta 0 and a gradient clip of 1 (its defaults too). The trained model is
saved under ``OUT/model`` and evaluated by ``tba eval`` (greedy, the task's evaluation problems),
before training and after; ``OUT/peer.json`` gets the row. Needs ``pip install trl==1.16.0``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import harness  # noqa: F401  (puts the checkout's src first on the path)


def evaluate(model_dir: Path, overrides: list[str]) -> float:
    task = [o for o in overrides if o.startswith("--task.")]
    proc = subprocess.run(
        [sys.executable, "-m", "tba", "eval", str(model_dir), *task, "--logging.progress=false"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"tba eval failed:\n{proc.stderr[-2000:]}")
    return json.loads((model_dir / "eval.json").read_text())["metrics"]["eval/accuracy"]


def main() -> None:
    out, seed, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tba.config import load_config
    from tba.models.builtin import BUILTIN_PREFIX, builtin_location
    from tba.tasks import build_task

    cfg = load_config(None, overrides)
    policy = cfg.model.policy
    path = builtin_location(policy, cfg.task) if policy.startswith(BUILTIN_PREFIX) else Path(policy)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = build_task(cfg.task, tokenizer=tokenizer)
    g, t = cfg.generation, cfg.trainer
    steps, per_step = t.steps, g.prompts_per_batch * g.group_size
    prompts = task.sample_prompts(steps * g.prompts_per_batch, random.Random(seed))
    by_text = {p.text: p for p in prompts}
    data = Dataset.from_list([{"prompt": p.text} for p in prompts])

    def reward(prompts, completions, **_):
        return [float(task.reward(by_text[p], c)) for p, c in zip(prompts, completions, strict=True)]

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.set_num_threads(2)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=per_step,
        num_generations=g.group_size,
        learning_rate=t.lr,
        lr_scheduler_type="constant" if t.lr_schedule == "constant" else "cosine",
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=g.temperature,
        max_completion_length=g.max_new_tokens,
        shuffle_dataset=False,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        logging_steps=max(1, steps // 20),
        disable_tqdm=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    start_dir = out / "start"
    if not (start_dir / "eval.json").is_file():
        model.save_pretrained(start_dir)
        tokenizer.save_pretrained(start_dir)
    initial = evaluate(start_dir, overrides)
    began = time.time()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    wall = time.time() - began
    final_dir = out / "model"
    trainer.model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    final = evaluate(final_dir, overrides)
    norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    row = {
        "initial": initial,
        "final": final,
        "last3": None,
        "evals": [[0, initial], [steps, final]],
        "grad_norm_median": float(sorted(norms)[len(norms) // 2]) if norms else None,
        "grad_norm_max": max(norms) if norms else None,
        "wall_s": round(wall, 1),
        "trl": __import__("trl").__version__,
    }
    (out / "peer.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
