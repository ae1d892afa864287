"""``tba eval``: evaluate a run, a checkpoint or any model on its task, with the evaluation that
training runs (:class:`tba.evaluation.Evaluator`), and compare several in one table.

    tba eval runs/demo                          # the run's latest checkpoint, with the run's config
    tba eval runs/demo --checkpoint 300         # checkpoints/step_300
    tba eval runs/demo/checkpoints/step_300     # the same
    tba eval Qwen/Qwen2.5-0.5B configs/gsm8k_qwen.yaml --eval.limit=200
    tba eval runs/a --compare runs/b runs/c     # one table, a column each

A run directory (or a checkpoint inside one) brings its own ``config.yaml``; any other model id or
path is evaluated with the config given (the built-in demo's defaults without one).
``--section.key=value`` overrides apply to every target (``--eval.samples=8 --eval.pass_k=[1,4]``).
Each target's results go to ``eval.json`` next to its checkpoint (inside a local model directory;
for a hub id only with ``--output``); ``--output PATH`` writes all of them to one file.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tba.config import ConfigError, load_config
from tba.errors import UserError, report

USAGE = """usage: tba eval TARGET [CONFIG.yaml] [--checkpoint STEP] [--compare TARGET ...] [--output PATH]
                       [--section.key=value ...] [--debug]

TARGET: a run directory (its latest checkpoint), a checkpoint directory, or a model id or path
(with CONFIG.yaml for its task; the demo's defaults without one).
  tba eval runs/demo
  tba eval runs/demo --checkpoint 300 --eval.limit=100
  tba eval runs/a --compare runs/b
"""


@dataclass
class Target:
    """What to evaluate: a config, and the checkpoint whose policy weights replace model.policy's."""

    label: str
    cfg: object
    checkpoint: Path | None
    step: int | None
    out: Path | None  # where eval.json goes; None: nowhere (a hub id without --output)


def cli_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    debug = "--debug" in argv
    try:
        args = parse_args([a for a in argv if a != "--debug"])
        targets = [resolve_target(t, args["config"], args["overrides"], args["checkpoint"]) for t in args["targets"]]
        results = [evaluate_target(t) for t in targets]
    except (UserError, ConfigError) as err:
        return report(err, debug)
    print_table(results)
    for result, target in zip(results, targets, strict=True):
        if target.out is not None:
            target.out.write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {target.out}", file=sys.stderr)
    if args["output"] is not None:
        args["output"].write_text(json.dumps(results if len(results) > 1 else results[0], indent=2) + "\n")
        print(f"wrote {args['output']}", file=sys.stderr)
    return 0


def parse_args(argv: list[str]) -> dict:
    """``TARGET [CONFIG] [--checkpoint S] [--compare T ...] [--output P] [--a.b=c ...]``."""
    targets: list[str] = []
    config: str | None = None
    checkpoint: str | None = None
    output: Path | None = None
    overrides: list[str] = []
    i, comparing = 0, False
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if arg in ("--checkpoint", "--output", "-o"):
            if value is None or value.startswith("-"):
                raise ConfigError(f"{arg} needs a value")
            if arg == "--checkpoint":
                checkpoint = value
            else:
                output = Path(value)
            i += 2
            continue
        if arg == "--compare":
            comparing = True
        elif arg.startswith("--"):
            if "." not in arg.split("=", 1)[0]:
                raise ConfigError(f"unknown option {arg}; see tba eval --help")
            overrides.append(arg)
            if "=" not in arg and value is not None and not value.startswith("--"):
                overrides.append(value)  # --a.b VALUE
                i += 1
        elif arg.endswith((".yaml", ".yml")) and not comparing and config is None and targets:
            config = arg
        elif comparing or not targets:
            targets.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give a target, then at most one config file")
        i += 1
    if not targets:
        raise ConfigError("no target: give a run directory, a checkpoint directory or a model")
    return {"targets": targets, "config": config, "checkpoint": checkpoint, "output": output, "overrides": overrides}


def resolve_target(target: str, config: str | None, overrides: list[str], checkpoint: str | None) -> Target:
    """A run directory, a checkpoint directory inside one, or a model id/path with ``config``."""
    from tba.checkpoint import latest_checkpoint

    path = Path(target).expanduser()
    run_dir, ckpt = None, None
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        run_dir = path
        if checkpoint is not None:
            name = checkpoint if str(checkpoint).startswith("step_") else f"step_{checkpoint}"
            ckpt = path / "checkpoints" / name
            if not ckpt.is_dir():
                have = sorted(p.name for p in (path / "checkpoints").glob("step_*"))
                raise UserError(f"{path} has no checkpoint {name}; it has {', '.join(have) or 'none'}")
        else:
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise UserError(
                    f"{path} holds no checkpoint (a run saves one at its end and every trainer.checkpoint_every "
                    "steps); evaluate a model path instead"
                )
    elif (
        path.name.startswith("step_")
        and (path / "trainer_state.json").is_file()
        and (path.parent.parent / "config.yaml").is_file()
    ):
        run_dir, ckpt = path.parent.parent, path  # a checkpoint of a run (one without it is a model)
    elif path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file; give a run directory, a checkpoint directory or a model directory")
    elif (
        not path.exists()
        and not target.startswith("builtin:")
        and (target.startswith((".", "/", "~")) or target.count("/") != 1)
    ):
        raise UserError(
            f"{target} does not exist and is not a Hugging Face model id (owner/name); "
            "give a run directory, a checkpoint directory or a model"
        )
    if run_dir is not None:
        cfg = load_config(config or run_dir / "config.yaml", overrides)
        m = cfg.model
        if m.lora is None:
            updates = {"reference": m.reference or m.policy}  # the run's reference: its starting model
            if m.tokenizer is None and not m.policy.startswith("builtin:"):
                updates["tokenizer"] = str(ckpt)  # saved beside the weights; no hub access needed
            cfg = cfg.model_copy(update={"model": m.model_copy(update=updates)})
        label = f"{run_dir.name}@{ckpt.name}"
    else:
        cfg = load_config(config, [*overrides, f"--model.policy={target}"])
        label = path.name if path.exists() else target
    local = path.is_dir()
    if ckpt is not None:
        out = ckpt / "eval.json"
    else:
        out = path / "eval.json" if local else None
    step = int(ckpt.name.split("_", 1)[1]) if ckpt is not None and ckpt.name.split("_", 1)[1].isdigit() else None
    return Target(label, cfg, ckpt, step, out)


def evaluate_target(target: Target) -> dict:
    """Load and evaluate one target; its results as written to ``eval.json``."""
    import torch

    from tba.config import absolute_paths
    from tba.demo import BUILTIN_PREFIX
    from tba.plan import Hardware, plan_run
    from tba.runtime.build import load_evaluator
    from tba.runtime.policy import seed_everything
    from tba.runtime.preflight import prepare_task, ready_plan

    cfg = absolute_paths(target.cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    where = f" ({target.checkpoint})" if target.checkpoint is not None else ""
    log(f"evaluating {target.label}{where}")
    start = time.perf_counter()
    prepared = prepare_task(cfg.model, cfg.task, cfg.objective, cfg.eval.samples, log)
    cfg, plan = plan_run(cfg, hardware=Hardware.detect())  # (every auto decided; no load watch, as before)
    plan = ready_plan(cfg.model, cfg.generation, cfg.task, plan, prepared[1], log, task=prepared[0])
    evaluator = load_evaluator(cfg, plan, target.checkpoint, log, prepared=prepared)
    result = evaluator()
    model = str(target.checkpoint) if target.checkpoint is not None else cfg.model.policy
    if model.startswith(BUILTIN_PREFIX):
        model = f"{model} (untrained)"
    return {
        "target": target.label,
        "model": model,
        "step": target.step,
        "task": cfg.task.name,
        "metrics": result.metrics,
        "settings": cfg.eval.model_dump(mode="json", by_alias=True),
        "seconds": round(time.perf_counter() - start, 2),
        "date": datetime.now().isoformat(timespec="seconds"),
        "samples": result.samples,
    }


def print_table(results: list[dict]) -> None:
    """One row per metric, one column per target."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"evaluation ({results[0]['task']})" if len({r["task"] for r in results}) == 1 else "evaluation"
    )
    table.add_column("metric")
    for r in results:
        table.add_column(r["target"], justify="right")
    keys = list(dict.fromkeys(k for r in results for k in r["metrics"]))
    for key in keys:
        table.add_row(key, *(_fmt(r["metrics"].get(key)) for r in results))
    Console().print(table)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return f"{value:.0f}"
    return f"{value:.4g}"
