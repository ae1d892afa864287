"""What every runtime does the same way: open the run directory, evaluate, checkpoint, resume,
summarise."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from tba.checkpoint import (
    latest_checkpoint,
    load_policy_weights,
    read_trainer_state,
    restore_global_rng,
    save_checkpoint,
)
from tba.config import Config, dump_config
from tba.console import summary_table
from tba.evaluation import Evaluator, write_samples
from tba.metrics import MetricsLogger, check_backends, read_metrics
from tba.models.loading import resolve_dtype
from tba.models.precision import compute_as
from tba.runtime.components import (
    Components,
    absolute_paths,
    check_models,
    check_run_dir,
    prepare_run_dir,
    prepare_task,
    seed_everything,
)


def open_run(cfg: Config, console: Console) -> tuple[Config, Path, tuple]:
    """Check everything a user can get wrong before the run directory exists, cheapest first: the
    run directory (a free name, or a checkpoint to resume), the packages of the logging backends
    that are on, the device, the task (dataset, prompt lengths, reward functions' dry run), the
    models (found, causal LMs; the demo model is built here on first use); then seed, create (or
    reopen, on resume) the run directory, and write the resolved config. Returns the config with
    local paths made absolute, the run directory, and the prepared task. Each check raises a
    :class:`tba.errors.UserError` that says what to fix."""
    from tba.models.loading import resolve_device

    log = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    cfg = absolute_paths(cfg)
    run_dir = check_run_dir(cfg)
    check_backends(cfg.logging)
    resolve_device(cfg.run.device)
    prepared = prepare_task(cfg, log)
    check_models(cfg, log)
    seed_everything(cfg.run.seed)
    run_dir = prepare_run_dir(cfg, run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    console.print(f"run directory: {run_dir}", highlight=False)
    return cfg, run_dir, prepared


def evaluate_policy(
    c: Components, cfg: Config, run_dir: Path | None = None, step: int = 0, metrics: MetricsLogger | None = None
) -> dict:
    """Evaluate the trainer's policy; append a few completions with their scores to
    ``<run>/samples.jsonl`` and, given ``metrics``, to its TensorBoard and W&B; return the ``eval/*``
    metrics."""
    evaluator = policy_evaluator(c, cfg)
    c.trainer.sync_policy()  # trainer ranks: their weights into this process's copy
    if evaluator.separate_copy:  # the searcher's vLLM engine, lent for this
        evaluator.generator.load_weights(c.trainer.published_state(), version=c.trainer.version)
        try:
            result = evaluator()
        finally:
            c.searcher.reload_weights()
    else:
        with compute_as(c.policy, resolve_dtype(cfg.model.dtype, c.trainer.device)):  # as searchers compute
            result = evaluator()
    if run_dir is not None:
        write_samples(run_dir, step, result.samples)
    if metrics is not None:
        metrics.log_samples(step, result.samples)
    return result.metrics


def policy_evaluator(c: Components, cfg: Config) -> Evaluator:
    """The evaluator of the trainer's own policy (built on first use). With vLLM searchers in the
    sync runtime it generates on the searcher's engine (loaded with the trainer's weights for each
    evaluation, the searcher's own reloaded after); otherwise with HF ``generate`` on the policy (the
    ray runtime's trainer holds no engine: ``eval.async=true`` evaluates on the evaluation actor's)."""
    if c.evaluator is None:
        # The frozen reference for evaluations that need it (KL): the searcher's in the sync
        # runtime; in the ray runtime, where the trainer holds none, built once on first use.
        if c.searcher is not None:
            searcher = c.searcher
            reference = lambda: searcher.reference  # noqa: E731
        else:
            from tba.runtime.components import lazy_reference

            reference = lazy_reference(cfg, c.policy)
        engine = None
        if c.searcher is not None and cfg.generation.backend == "vllm":
            engine = c.searcher.generator
            engine = getattr(engine, "inner", engine)  # past random exploration: evaluation samples as configured
        c.evaluator = Evaluator(cfg, c.task, c.tokenizer, c.policy, c.eos_ids, reference, engine)
    return c.evaluator


def eval_key(c: Components) -> str:
    """The metric that evaluation reports: ``eval/accuracy``, ``eval/reward``, ..."""
    return f"eval/{c.task.eval_metric}"


def log_errors(run_dir: Path, errors: list[str]) -> None:
    """Append reward-function tracebacks to ``<run>/errors.log`` (the first of each function)."""
    if errors:
        with (run_dir / "errors.log").open("a") as f:
            for text in errors:
                f.write(text.rstrip() + "\n\n")


def save(c: Components, run_dir: Path, extra: dict | None = None) -> Path:
    """Checkpoint the trainer side and, where this process holds one (the sync runtime), the
    searcher side: its state and the newest published weights, so that a resume continues exactly."""
    extra = dict(extra or {})
    c.trainer.sync_policy()  # trainer ranks: their weights into this process's copy, which is saved
    if c.searcher is not None:
        extra["searcher"] = c.searcher.state_dict()
        extra["published"] = _published(c)
    return save_checkpoint(
        run_dir,
        c.policy,
        c.tokenizer,
        c.trainer.state_dict(),
        c.buffer.state_dict(),
        extra,
        merged=c.trainer.cfg.save_merged,
        keep=c.trainer.cfg.keep_checkpoints,
    )


def _published(c: Components) -> dict:
    """The weight store's newest version; its weights too when they are not the policy's own (the
    checkpoint falls between two publications, with ``trainer.sync_interval`` > 1)."""
    newest = c.trainer.weights.fetch(newer_than=-1)
    if newest is None:
        return {"version": -1}
    version, state = newest
    if version == c.trainer.version:
        return {"version": version}
    return {"version": version, "weights": dict(state)}


def resume(c: Components, run_dir: Path, log) -> bool:
    """Load the latest checkpoint of ``run_dir``; False if there is none. The trainer side
    (weights, optimizer, schedule, buffer, random states) always; with a searcher in this process
    (the sync runtime) also its state and the published weights, which it then republishes: the
    run continues bit for bit as if it had not stopped."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        log(f"no checkpoint in {run_dir}; starting from scratch")
        return False
    state = read_trainer_state(ckpt)  # refuses an unsafe (pickled) checkpoint before anything loads
    load_policy_weights(c.policy, ckpt)  # the adapter alone for a LoRA policy
    c.trainer.load_state_dict(state["trainer"])
    c.buffer.load_state_dict(state["buffer"])
    if c.searcher is not None:
        _resume_searcher(c, state["extra"])
    restore_global_rng(state["rng"])  # last: loading models above may draw random numbers
    drop_metrics_after(run_dir / "metrics.jsonl", c.trainer.version)
    drop_metrics_after(run_dir / "samples.jsonl", c.trainer.version)
    log(f"resumed from {ckpt} at step {c.trainer.version}")
    return True


def _resume_searcher(c: Components, extra: dict) -> None:
    """Restore the searcher and republish what it would load next, without opening a new recent
    window in the buffer (the restored buffer has the windows it had)."""
    published = extra.get("published", {"version": -1})
    if "searcher" not in extra or published["version"] < 0:  # a checkpoint of the ray runtime
        c.trainer.publish()
        return
    c.searcher.load_state_dict(extra["searcher"])
    version = published["version"]
    weights = published.get("weights") or c.trainer.published_state()
    c.trainer.weights.publish(weights, version)
    if c.searcher.version == version:  # it holds these weights already, so it would not pull them
        c.searcher.generator.load_weights(weights, version)


def drop_metrics_after(path: Path, step: int) -> None:
    """Steps after the checkpoint will be trained again: set their old records aside (kept in
    ``<name>.before-resume``, numbered if that exists) so the file reads as one run."""
    if not path.is_file():
        return
    records = read_metrics(path)
    if all(r["step"] <= step for r in records):
        return
    aside = path.with_name(path.name + ".before-resume")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.before-resume-{n}")
    path.rename(aside)
    with path.open("w") as f:
        for r in records:
            if r["step"] <= step:
                f.write(json.dumps(r) + "\n")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_summary(run_dir: Path, c: Components, cfg: Config, start: float, extra: dict | None = None) -> dict:
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
        "runtime": cfg.runtime.type,
        "policy": c.policy_path,
        "task": cfg.task.name,
        **(extra or {}),
    }
    sampled_k = {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith(("eval/pass@", "eval/maj@"))}
    summary.update({f"{k}_final": v for k, v in sampled_k.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def print_summary(console: Console, s: dict, cfg: Config, run_dir: Path | None = None) -> None:
    key = next(k[: -len("_initial")] for k in s if k.startswith("eval/") and k.endswith("_initial"))
    rate = key in ("eval/accuracy", "eval/win_rate", "eval/attack_success_rate")
    pattern = "{:.1%}" if rate else "{:.3f}"
    if cfg.task.name == "redteam":
        from tba.tasks.redteam import DEFAULT_EVAL_ATTACKS

        decoding = f"{cfg.eval.samples if cfg.eval.samples > 1 else DEFAULT_EVAL_ATTACKS} sampled attacks"
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
    title = f"{cfg.task.name}, {cfg.runtime.type} runtime: {s['trainer_steps']} steps in {s['wall_clock_s']:.0f} s"
    console.print(summary_table(rows, title))
    if run_dir is not None:
        print_samples(console, run_dir)
        if (run_dir / "errors.log").is_file():
            console.print(f"reward-function errors were skipped and counted; tracebacks: {run_dir / 'errors.log'}")


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
