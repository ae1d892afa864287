"""What a run reports: evaluations of the policy at their steps (with the engine or HF
``generate``), per-sample errors, and the summary, written to ``summary.json`` and printed with a
few samples."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from tba.console import summary_table
from tba.evaluation import write_samples
from tba.machine import describe_machine
from tba.metrics import MetricsLogger, read_metrics
from tba.models.precision import compute_as
from tba.plots import plot_run
from tba.runtime.components import Components, policy_evaluator
from tba.runtime.pace import pace_line
from tba.tasks.redteam import DEFAULT_EVAL_ATTACKS
from tba.types import LoggedError


def evaluate_policy(
    c: Components, run_dir: Path | None = None, step: int = 0, metrics: MetricsLogger | None = None
) -> dict:
    """Evaluate the trainer's policy; append a few completions with their scores to
    ``<run>/samples.jsonl`` and, given ``metrics``, to its TensorBoard and W&B; return the ``eval/*``
    metrics."""
    evaluator = policy_evaluator(c)
    c.trainer.sync_policy()  # trainer ranks: their weights into this process's copy
    if evaluator.separate_copy:  # the searcher's vLLM engine, lent for this
        evaluator.generator.load_weights(c.trainer.published_state(), version=c.trainer.version)
        try:
            result = evaluator()
        finally:
            c.searcher.reload_weights()
    else:
        with compute_as(c.policy, c.plan.torch_dtype):  # as searchers compute
            result = evaluator()
    if run_dir is not None:
        write_samples(run_dir, step, result.samples, result.answers)
    if metrics is not None:
        metrics.log_samples(step, result.samples)
    return result.metrics


def eval_key(c: Components) -> str:
    """The metric that evaluation reports: ``eval/accuracy``, ``eval/reward``, ..."""
    return f"eval/{c.task.eval_metric}"


ERRORS_COUNTS = "errors.json"  # beside errors.log: how many of its entries are of each kind


def log_errors(run_dir: Path, errors: list[LoggedError]) -> None:
    """Append failures' first tracebacks and the run's notices to ``<run>/errors.log``, and count
    each kind in ``<run>/errors.json`` (what the run's last line says the log holds)."""
    if not errors:
        return
    with (run_dir / "errors.log").open("a") as f:
        for e in errors:
            f.write(e.text.rstrip() + "\n\n")
    path = run_dir / ERRORS_COUNTS
    counts = json.loads(path.read_text()) if path.is_file() else {}
    for e in errors:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    path.write_text(json.dumps(counts) + "\n")


def say_event(run_dir: Path, log, message: str) -> None:
    """Something the run must tell even when quiet (a searcher's death or return, a fall below the
    start): through ``log`` and, with the time, in ``errors.log``."""
    log(message)
    log_errors(run_dir, [LoggedError("notice", f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}")])


def errors_log_contents(path: Path) -> str:
    """What ``errors.log`` holds, in words, by the counts written beside it (:func:`log_errors`):
    the reward functions' first tracebacks (one per failing function and searcher, their samples
    skipped and counted), the first traceback of each kind of environment, agent or verifiers
    failure (their rollouts dropped and counted) and the run's notices (:func:`say_event`: a
    searcher's death or return, a fall below the start, steps slowed by other processes)."""
    counts_path = path.parent / ERRORS_COUNTS
    counts = json.loads(counts_path.read_text()) if counts_path.is_file() else {}
    parts = []
    if counts.get("reward"):
        parts.append(
            f"{counts['reward']} reward-function traceback(s) (the first of each failing function; its samples "
            "were skipped and counted in searcher/reward_errors)"
        )
    if counts.get("rollout"):
        parts.append(
            f"{counts['rollout']} environment or agent traceback(s) (the first of each kind; those rollouts were "
            "dropped and counted in searcher/environment_errors)"
        )
    if counts.get("notice"):
        parts.append(
            f"{counts['notice']} notice(s) of the run (a searcher that died or came back, a fall below the start, "
            "a slowdown)"
        )
    return "errors.log holds " + (" and ".join(parts) if parts else "nothing the run wrote")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_summary(run_dir: Path, c: Components, start: float, extra: dict | None = None) -> dict:
    history = read_metrics(run_dir / "metrics.jsonl")
    key = eval_key(c)
    evals = [r for r in history if r.get(key) is not None]
    trained = [r["train/reward_mean"] for r in history if r.get("train/reward_mean") is not None]
    sampled = [r["searcher/reward_mean"] for r in history if r.get("searcher/reward_mean") is not None]
    lags = [r["train/lag_mean"] for r in history if r.get("train/lag_mean") is not None]
    peaks = [r["train/peak_memory_gb"] for r in history if r.get("train/peak_memory_gb") is not None]
    rank_peaks = [r["train/rank_peak_memory_gb"] for r in history if r.get("train/rank_peak_memory_gb") is not None]
    summary = {
        f"{key}_initial": evals[0][key] if evals else None,
        f"{key}_final": evals[-1][key] if evals else None,
        "train/reward_mean_first": trained[0] if trained else None,
        "train/reward_mean_last10": _mean(trained[-10:]),
        "searcher/reward_mean_first10": _mean(sampled[:10]),
        "searcher/reward_mean_last10": _mean(sampled[-10:]),
        "lag_mean": _mean(lags),
        "peak_memory_gb": round(max(peaks), 3) if peaks else None,  # the trainer process's
        **({"rank_peak_memory_gb": round(max(rank_peaks), 3)} if rank_peaks else {}),  # trainer.num_ranks > 1
        "wall_clock_s": round(time.time() - start, 1),
        "trainer_steps": c.trainer.version,
        "runtime": c.plan.runtime,
        "policy": c.policy_path,
        "task": c.task_name,
        "environment": describe_machine(),
        "prompts": c.ledger.summary(),  # every prompt drawn, per searcher (tba.runtime.ledger)
        **(extra or {}),
    }
    sampled_k = {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith(("eval/pass@", "eval/maj@"))}
    summary.update({f"{k}_final": v for k, v in sampled_k.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def print_summary(console: Console, s: dict, eval_samples: int = 1, run_dir: Path | None = None) -> None:
    key = next(k[: -len("_initial")] for k in s if k.startswith("eval/") and k.endswith("_initial"))
    rate = key in ("eval/accuracy", "eval/win_rate", "eval/attack_success_rate")
    pattern = "{:.1%}" if rate else "{:.3f}"
    if s["task"] == "redteam":
        decoding = f"{eval_samples if eval_samples > 1 else DEFAULT_EVAL_ATTACKS} sampled attacks"
    else:
        decoding = "greedy"
    rows = [
        (
            f"eval {key.split('/', 1)[1]} ({decoding})",
            _fmt(s[f"{key}_initial"], pattern),
            _fmt(s[f"{key}_final"], pattern),
        ),
        (
            "sampled reward (mean of 10 batches)",
            _fmt(s["searcher/reward_mean_first10"], "{:.3f}"),
            _fmt(s["searcher/reward_mean_last10"], "{:.3f}"),
        ),
    ]
    title = f"{s['task']}, {s['runtime']} runtime: {s['trainer_steps']} steps in {s['wall_clock_s']:.0f} s"
    console.print(summary_table(rows, title))
    pace = pace_line(s)
    if pace:
        console.print(pace, highlight=False, markup=False)
    if run_dir is not None:
        print_samples(console, run_dir)
        if (run_dir / "errors.log").is_file():
            console.print(f"{errors_log_contents(run_dir / 'errors.log')}: {run_dir / 'errors.log'}", highlight=False)


def print_samples(console: Console, run_dir: Path, count: int = 3, width: int = 300) -> None:
    """The last evaluation's first few completions: what the model writes now."""
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return
    records = read_metrics(path)
    if not records:
        return
    last = [r for r in records if r["step"] == records[-1]["step"]][:count]
    console.print(f"samples at step {last[0]['step']} (all in {path}):", highlight=False)
    for r in last:
        prompt = " ".join(str(r["prompt"]).split())[-width:]
        completion = str(r["completion"]).strip()[:width]
        answer = f"  (reference: {r['answer']})" if r.get("answer") is not None else ""
        console.print(
            f"  prompt: {prompt}\n  completion: {completion}\n  score: {r['score']}{answer}",
            highlight=False,
            markup=False,
        )


def finish(console: Console, run_dir: Path, c: Components, start: float, extra: dict | None = None) -> dict:
    """The end of every run: ``summary.json`` written, the plots drawn, the summary printed."""
    summary = write_summary(run_dir, c, start, extra)
    plot_run(run_dir, eval_key(c))
    print_summary(console, summary, c.evaluation.samples if c.evaluation else 1, run_dir)
    return summary
