"""What every runtime does the same way: open the run directory, evaluate, checkpoint, resume,
summarise."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from tba.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from tba.config import Config, dump_config
from tba.console import summary_table
from tba.evaluation import evaluate
from tba.metrics import read_metrics
from tba.runtime.components import Components, prepare_run_dir, seed_everything


def open_run(cfg: Config, console: Console) -> Path:
    """Seed, create (or reopen, on resume) the run directory, and write the resolved config."""
    seed_everything(cfg.run.seed)
    run_dir = prepare_run_dir(cfg)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    console.print(f"run directory: {run_dir}", highlight=False)
    return run_dir


def evaluate_policy(c: Components, cfg: Config) -> dict:
    max_new = cfg.eval.max_new_tokens or cfg.generation.max_new_tokens
    c.eval_generator.batch_size = cfg.eval.batch_size
    return evaluate(c.task, c.eval_generator, c.tokenizer, max_new, cfg.model.chat_template, c.eos_ids)


def save(c: Components, run_dir: Path, extra: dict | None = None) -> Path:
    return save_checkpoint(run_dir, c.policy, c.tokenizer, c.trainer.state_dict(), c.buffer.state_dict(), extra)


def resume(c: Components, run_dir: Path, log) -> bool:
    """Load the latest checkpoint of ``run_dir`` into the trainer side; False if there is none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        log(f"no checkpoint in {run_dir}; starting from scratch")
        return False
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(c.policy.parameters()).dtype)
    c.policy.load_state_dict(saved.state_dict())
    state = load_trainer_state(ckpt)
    c.trainer.load_state_dict(state["trainer"])
    c.buffer.load_state_dict(state["buffer"])
    drop_metrics_after(run_dir / "metrics.jsonl", c.trainer.version)
    log(f"resumed from {ckpt} at step {c.trainer.version}")
    return True


def drop_metrics_after(path: Path, step: int) -> None:
    """Steps after the checkpoint will be trained again: set their old records aside (kept in
    ``metrics.jsonl.before-resume``) so the metrics file reads as one run."""
    if not path.is_file():
        return
    records = read_metrics(path)
    if all(r["step"] <= step for r in records):
        return
    path.rename(path.with_name(path.name + ".before-resume"))
    with path.open("w") as f:
        for r in records:
            if r["step"] <= step:
                f.write(json.dumps(r) + "\n")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_summary(run_dir: Path, c: Components, cfg: Config, start: float, extra: dict | None = None) -> dict:
    history = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in history if r.get("eval/accuracy") is not None]
    trained = [r["train/reward_mean"] for r in history if r.get("train/reward_mean") is not None]
    sampled = [r["searcher/reward_mean"] for r in history if r.get("searcher/reward_mean") is not None]
    lags = [r["train/lag_mean"] for r in history if r.get("train/lag_mean") is not None]
    summary = {
        "eval/accuracy_initial": evals[0]["eval/accuracy"] if evals else None,
        "eval/accuracy_final": evals[-1]["eval/accuracy"] if evals else None,
        "train/reward_mean_first": trained[0] if trained else None,
        "train/reward_mean_last10": _mean(trained[-10:]),
        "searcher/reward_mean_first10": _mean(sampled[:10]),
        "searcher/reward_mean_last10": _mean(sampled[-10:]),
        "lag_mean": _mean(lags),
        "wall_clock_s": round(time.time() - start, 1),
        "trainer_steps": c.trainer.version,
        "runtime": cfg.runtime.type,
        "policy": c.policy_path,
        **(extra or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def print_summary(console: Console, s: dict, cfg: Config) -> None:
    rows = [
        (
            "eval accuracy (greedy)",
            _fmt(s["eval/accuracy_initial"], "{:.1%}"),
            _fmt(s["eval/accuracy_final"], "{:.1%}"),
        ),
        (
            "sampled reward (mean of 10 batches)",
            _fmt(s["searcher/reward_mean_first10"], "{:.3f}"),
            _fmt(s["searcher/reward_mean_last10"], "{:.3f}"),
        ),
    ]
    title = f"{cfg.task.name}, {cfg.runtime.type} runtime: {s['trainer_steps']} steps in {s['wall_clock_s']:.0f} s"
    console.print(summary_table(rows, title))
