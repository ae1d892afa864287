"""What the tests of the ecosystem's sources (agents, verifiers, OpenEnv) share: a three-step run
of the tiny models, and its training records checked."""

from __future__ import annotations

from tba.metrics import read_metrics

THREE_STEPS = [
    "--trainer.steps=3",
    "--trainer.batch_prompts=4",
    "--generation.prompts_per_batch=4",
    "--generation.group_size=4",
    "--trainer.checkpoint_every=3",
    "--eval.every=3",
    "--logging.progress=false",
    "--runtime.trainer_cpus=1",
    "--run.threads=1",
]


def trained_three_steps(run_dir, summary: dict) -> tuple[list[dict], list[dict]]:
    """The run's records and its training records, after checking that it trained steps 1-3."""
    assert summary["trainer_steps"] == 3
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    return records, train
