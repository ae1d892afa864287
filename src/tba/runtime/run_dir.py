"""A run's directory: its absolute paths and checks before anything is made, preparing it (config,
environment), opening a run (models and task checked, resume detected), checkpoints (saved, and a
resume from the newest), and removing a run that never took a step."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path

from rich.console import Console

from tba.checkpoint import (
    latest_checkpoint,
    load_policy_weights,
    read_trainer_state,
    restore_global_rng,
    save_checkpoint,
)
from tba.config import Config, RunConfig, dump_config
from tba.errors import RunDirError
from tba.machine import describe_machine, machine_line
from tba.metrics import check_backends, read_metrics
from tba.plan import Plan
from tba.runtime.build import Components
from tba.runtime.policy import seed_everything
from tba.runtime.preflight import prepare_task, ready_plan

created_run_dirs: list[Path] = []
"""Run directories that :func:`prepare_run_dir` created in this process, so that a start that fails
can remove its own directory (:func:`remove_unstarted`) and leave the name free."""


def check_run_dir(run: RunConfig, task_name: str) -> Path:
    """The run directory of ``run`` settings (``run.name``, else the task's name and the time),
    checked without creating anything: a new run needs a free name and a writable
    ``run.output_dir``; a resume needs a checkpoint. Raises :class:`RunDirError`."""

    name = run.name or f"{task_name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(run.output_dir).expanduser() / name
    if run.resume:
        if not run_dir.is_dir():
            raise RunDirError(
                f"run.resume=true but {run_dir} does not exist; check run.output_dir and run.name, "
                "or drop --run.resume to start a new run"
            )
        if latest_checkpoint(run_dir) is None:
            raise RunDirError(
                f"run.resume=true but {run_dir} holds no checkpoint, so there is nothing to resume; "
                f"start afresh under another run.name (or delete {run_dir})"
            )
        return run_dir
    if run_dir.exists() and not unstarted(run_dir):
        raise RunDirError(
            f"run directory {run_dir} already holds a run; pick another run.name, "
            "or pass --run.resume=true to continue it"
        )
    parent = run_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "is a file, not a folder" if parent.exists() and not parent.is_dir() else "is not writable"
        raise RunDirError(
            f"cannot create run directory {run_dir}: {parent} {what}; set run.output_dir to a writable folder"
        )
    return run_dir


def prepare_run_dir(run_dir: Path) -> Path:
    """Create (or reopen, on resume) the run directory that :func:`check_run_dir` approved."""
    fresh = not run_dir.exists()
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "plots").mkdir(exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"cannot create run directory {run_dir}: {err.strerror or err}; set run.output_dir to a writable folder"
        ) from err
    if fresh:
        created_run_dirs.append(run_dir)
    return run_dir


START_FILES = ("config.yaml", "environment.json", "plan.json")
"""What :func:`open_run` writes before anything else: the resolved config, the machine, the plan."""


def unstarted(run_dir: Path, step_zero: bool = False) -> bool:
    """The directory holds nothing a run wrote but what a start writes first (:data:`START_FILES`,
    and empty files or folders):
    the trace of a start that failed before training, which does not block reusing the name. With
    ``step_zero`` the records of the evaluation at step 0 (of the starting weights) count as
    nothing too: what a start that failed while its searchers started leaves in the ray runtime."""
    for path in run_dir.rglob("*"):
        if not path.is_file() or path.name in START_FILES or path.stat().st_size == 0:
            continue
        if step_zero and path.parent == run_dir and path.name in ("metrics.jsonl", "samples.jsonl"):
            if _step_zero_only(path):
                continue
        return False
    return True


def _step_zero_only(path: Path) -> bool:
    """Every line of a JSON-lines file is a record of step 0."""
    try:
        return all(json.loads(line).get("step") == 0 for line in path.read_text().splitlines() if line.strip())
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


def remove_unstarted(run_dir: Path, step_zero: bool = False) -> bool:
    """Delete ``run_dir`` if it holds no trace of training (see :func:`unstarted`); True if it did."""
    if run_dir.is_dir() and unstarted(run_dir, step_zero):
        shutil.rmtree(run_dir)
        return True
    return False


def open_run(cfg: Config, console: Console, plan: Plan) -> tuple[Config, Path, tuple, Plan]:
    """Check everything a user can get wrong before the run directory exists, cheapest first: the
    run directory (a free name, or a checkpoint to resume), the packages of the logging backends
    that are on, the device, the task (dataset, prompt lengths, reward functions' dry run), the
    models (found, causal LMs; the demo model is built here on first use); then seed, create (or
    reopen, on resume) the run directory, and write the resolved config, the run plan (``plan.json``,
    printed too: :mod:`tba.plan`) and the machine (``environment.json``:
    :func:`tba.machine.describe_machine`; a resume writes its own). ``cfg`` has its local paths made
    absolute already (:func:`tba.config.absolute_paths`: the plan is made from that config) and
    ``plan`` is the one made for it. Returns the config, the run directory, the prepared task and
    the plan (it gains the EOS ids here). Each check raises a :class:`tba.errors.UserError` that
    says what to fix."""

    log = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    run_dir = check_run_dir(cfg.run, cfg.task.name)
    check_backends(cfg.logging)
    prepared = prepare_task(cfg.model, cfg.task, cfg.objective, cfg.eval.samples, log)
    plan = ready_plan(cfg.model, cfg.generation, cfg.task, plan, prepared[1], log, task=prepared[0])
    seed_everything(cfg.run.seed)
    run_dir = prepare_run_dir(run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "environment.json").write_text(json.dumps(describe_machine(), indent=2) + "\n")
    console.print(f"run directory: {run_dir}", highlight=False)
    console.print(f"machine: {machine_line()}", highlight=False)
    plan.save(run_dir)
    for line in plan.lines():
        console.print(line, highlight=False, soft_wrap=True)
    return cfg, run_dir, prepared, plan


def save(c: Components, run_dir: Path, extra: dict | None = None) -> Path:
    """Checkpoint the trainer side and, where this process holds one (the sync runtime), the
    searcher side: its state and the newest published weights, so that a resume continues exactly."""
    extra = {**(extra or {}), "prompts": c.ledger.state_dict()}
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
    c.ledger.load_state_dict(state["extra"].get("prompts", {}))
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
    c.trainer.republish(weights, version)
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
