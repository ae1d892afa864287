"""Training settings that more than one study runs: ``bench_async_regimes.py``'s, which
``bench_layouts.py`` takes too. Each is a list of ``tba train`` arguments."""

from __future__ import annotations

from harness.models import default_dest

REAL_MODEL = default_dest()
"""SmolLM2-135M-Instruct's folder (``benchmarks/real_model.py`` builds it)."""

SETTINGS: dict[str, list[str]] = {
    "demo": [],
    "small": [
        "--task.operators=+",
        "--generation.group_size=8",
        "--generation.prompts_per_batch=8",
        "--trainer.batch_prompts=8",
        "--trainer.lr=1e-4",
        "--trainer.lr_schedule=constant",
        "--trainer.warmup_steps=0",
        "--trainer.steps=200",
        "--generation.temperature=1.0",
        "--generation.max_new_tokens=5",
        "--eval.every=50",
    ],
    "chains": [
        "--task.terms=5",
        "--task.digits=1",
        "--task.show_work=true",
        "--generation.max_new_tokens=40",
        "--trainer.steps=300",
        "--eval.every=50",
    ],
    "real": [
        "benchmarks/word_problems/run.yaml",
        f"--model.policy={REAL_MODEL}",
        "--trainer.steps=40",
        "--eval.every=10",
        "--trainer.checkpoint_every=null",
    ],
}
