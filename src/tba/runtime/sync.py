"""The synchronous runtime: one process alternates generate-then-train.

Each step the searcher generates a fresh batch with the newest published weights and the
trainer takes one optimizer step, sampling from the replay buffer exactly as it will when the
two run asynchronously. With ``trainer.sync_interval=1`` (the default) every batch is
on-policy: the baseline that asynchronous speedups are measured against, and the mode for
debugging.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.console import Console

from tba.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from tba.config import Config, dump_config
from tba.console import RunDisplay, summary_table
from tba.evaluation import evaluate
from tba.metrics import MetricsLogger, read_metrics
from tba.plots import plot_run
from tba.runtime.components import Components, build_components, prepare_run_dir, seed_everything


def run_sync(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    console = console or Console(stderr=True)
    start = time.time()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    run_dir = prepare_run_dir(cfg)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    log = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    log(f"run directory: {run_dir}")
    c = build_components(cfg, log)
    initial = _resume(c, run_dir, log) if cfg.run.resume else None
    metrics = MetricsLogger(run_dir, cfg.logging.tensorboard, start_time=start)
    try:
        if initial is None:
            c.trainer.publish()  # version 0: the searcher starts from the trainer's weights
            initial = _evaluate(c, cfg)
            metrics.log(0, initial)
        summary = _train(c, cfg, run_dir, metrics, initial, start)
    finally:
        metrics.close()  # whatever happened, what was logged stays on disk
    plot_run(run_dir)
    _print_summary(console, summary, cfg)
    return run_dir, summary


def _train(c: Components, cfg: Config, run_dir: Path, metrics: MetricsLogger, initial: dict, start: float) -> dict:
    trainer, searcher = c.trainer, c.searcher
    min_groups = cfg.buffer.min_groups or cfg.trainer.batch_prompts
    while c.buffer.num_prompts < min_groups or not c.buffer.can_sample(cfg.trainer.batch_prompts):
        trainer.ingest(searcher.step())
    first_reward = None
    with RunDisplay(cfg.trainer.steps, cfg.logging.progress) as display:
        display.update(trainer.version, initial)
        while trainer.version < cfg.trainer.steps:
            gen_start = time.perf_counter()
            trainer.ingest(searcher.step())
            gen_s = time.perf_counter() - gen_start
            record = trainer.step()
            step = trainer.version
            record["searcher/generate_s"] = gen_s
            record.update(searcher.metrics())
            if first_reward is None:
                first_reward = record["train/reward_mean"]
            if step % cfg.eval.every == 0 or step == cfg.trainer.steps:
                record.update(_evaluate(c, cfg))
            if step % cfg.logging.every == 0 or "eval/accuracy" in record:
                metrics.log(step, record)
            display.update(step, record)
            every = cfg.trainer.checkpoint_every
            if (every and step % every == 0) or step == cfg.trainer.steps:
                _checkpoint(c, run_dir)
    history = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in history if r.get("eval/accuracy") is not None]
    rewards = [r["train/reward_mean"] for r in history if r.get("train/reward_mean") is not None]
    sampled = [r["searcher/reward_mean"] for r in history if r.get("searcher/reward_mean") is not None]
    summary = {
        "eval/accuracy_initial": evals[0]["eval/accuracy"],
        "eval/accuracy_final": evals[-1]["eval/accuracy"],
        "train/reward_mean_first": rewards[0] if rewards else first_reward,
        "train/reward_mean_last10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        "searcher/reward_mean_first10": _mean(sampled[:10]),
        "searcher/reward_mean_last10": _mean(sampled[-10:]),
        "wall_clock_s": round(time.time() - start, 1),
        "trainer_steps": trainer.version,
        "runtime": cfg.runtime.type,
        "policy": c.policy_path,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _evaluate(c: Components, cfg: Config) -> dict:
    max_new = cfg.eval.max_new_tokens or cfg.generation.max_new_tokens
    c.eval_generator.batch_size = cfg.eval.batch_size
    return evaluate(c.task, c.eval_generator, c.tokenizer, max_new, cfg.model.chat_template, c.eos_ids)


def _checkpoint(c: Components, run_dir: Path) -> Path:
    return save_checkpoint(
        run_dir,
        c.policy,
        c.tokenizer,
        c.trainer.state_dict(),
        c.buffer.state_dict(),
        extra={"searcher_version": c.searcher.version},
    )


def _resume(c: Components, run_dir: Path, log) -> dict | None:
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        log(f"no checkpoint in {run_dir}; starting from scratch")
        return None
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(c.policy.parameters()).dtype)
    c.policy.load_state_dict(saved.state_dict())
    state = load_trainer_state(ckpt)
    c.trainer.load_state_dict(state["trainer"])
    c.buffer.load_state_dict(state["buffer"])
    c.trainer.publish()
    _drop_metrics_after(run_dir / "metrics.jsonl", c.trainer.version)
    log(f"resumed from {ckpt} at step {c.trainer.version}")
    return {}


def _drop_metrics_after(path: Path, step: int) -> None:
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


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_summary(console: Console, s: dict, cfg: Config) -> None:
    rows = [
        ("eval accuracy (greedy)", f"{s['eval/accuracy_initial']:.1%}", f"{s['eval/accuracy_final']:.1%}"),
        (
            "sampled reward (mean of 10 batches)",
            _fmt(s["searcher/reward_mean_first10"]),
            _fmt(s["searcher/reward_mean_last10"]),
        ),
    ]
    console.print(summary_table(rows, f"{cfg.task.name}: {s['trainer_steps']} steps in {s['wall_clock_s']:.0f} s"))
