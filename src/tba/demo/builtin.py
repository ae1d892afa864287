"""The built-in models by name (``builtin:tiny-arithmetic``, ``builtin:tiny-tools``): where each
setting's model is cached, and the model itself: the shipped one (checked by hash), else built on
first use and cached under ``$TBA_CACHE`` (default ``~/.cache/tba``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from tba.demo.index import shipped
from tba.demo.warm_start import TOOL_SPEC, warm_start, warm_start_tools
from tba.models.tiny import DEFAULT_SPEC, TinySpec, build_char_tokenizer, build_tiny_llama, build_tool_tokenizer
from tba.tasks.arithmetic import ArithmeticTask

BUILTIN_PREFIX = "builtin:"
TOOL_MODEL = "builtin:tiny-tools"


MULTI_TURN_SETTINGS = (
    "tools",
    "environment",
    "environment_args",
    "max_turns",
    "max_trajectory_tokens",
    "tool_timeout",
    "system_prompt",
    "environment_workers",
)


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("TBA_CACHE") or Path.home() / ".cache" / "tba")


def tiny_model_path(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, kind: str = "tiny-arithmetic"
) -> Path:
    """Where the demo checkpoint of this arithmetic setting is cached: named by a hash of the setting."""
    setting = task_cfg.model_dump()
    for name in ("reward_timeout", *MULTI_TURN_SETTINGS):  # how rollouts are run, not what the model learns
        setting.pop(name, None)
    for name, default in (("terms", 2), ("show_work", False)):  # settings added later: keep the old caches' keys
        if setting.get(name) == default:
            setting.pop(name, None)
    key = {"task": setting, "spec": asdict(spec)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"{kind}-{digest}"


def ensure_tiny_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """Path of the warm-started demo checkpoint for this arithmetic setting: the shipped one (checked
    by hash) for the settings the package ships, else built on first use and cached."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"builtin:tiny-arithmetic is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec)
    task = ArithmeticTask(
        task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms, task_cfg.show_work
    )
    found = shipped(path.name) if use_shipped else None
    return found or _cached(path, "demo model", spec, build_char_tokenizer, warm_start, task, log)


def ensure_tiny_tool_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = TOOL_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """Path of the warm-started tool demo checkpoint (``builtin:tiny-tools``) for this arithmetic
    setting: the shipped one (checked by hash), else built on first use and cached."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"{TOOL_MODEL} is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec, kind="tiny-tools")
    task = ArithmeticTask(task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms)
    found = shipped(path.name) if use_shipped else None
    return found or _cached(path, "tool demo model", spec, build_tool_tokenizer, warm_start_tools, task, log)


def _cached(path: Path, what: str, spec: TinySpec, make_tokenizer, warm, task, log) -> Path:
    """``path`` if it holds a finished build; else a tiny Llama over ``make_tokenizer()``, warm-started
    by ``warm(model, tokenizer, task, spec, log)`` and saved there."""
    if (path / "warm_start.json").is_file():
        return path
    log(f"building the {what} (once; cached at {path})")
    torch.manual_seed(spec.seed)
    tokenizer = make_tokenizer()
    model = build_tiny_llama(tokenizer, spec)
    info = warm(model, tokenizer, task, spec, log)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(info, indent=2))
    if path.exists():  # a half-written directory from an interrupted build
        shutil.rmtree(path)
    os.replace(tmp, path)  # atomic: a crash never leaves a cache entry that looks complete
    log(f"demo model ready: {info['parameters']:,} parameters, {info['steps']} warm-start steps")
    return path
