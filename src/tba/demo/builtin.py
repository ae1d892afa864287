"""The built-in models by name (``builtin:tiny-arithmetic``, ``builtin:tiny-tools``): where each
setting's model is cached, and the model itself: the shipped one (checked by hash), else built on
first use and cached under ``$TBA_CACHE`` (default ``~/.cache/tba``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tba.demo.warm_start import warm_start, warm_start_tools
from tba.models.builtin import (  # noqa: F401  (the names of tba.demo)
    BUILTIN_PREFIX,
    SHIPPED_DIR,
    TOOL_MODEL,
    TOOL_SPEC,
    builtin_location,
    cache_root,
    shipped,
    tiny_model_path,
)
from tba.models.tiny import DEFAULT_SPEC, TinySpec, build_char_tokenizer, build_tiny_llama, build_tool_tokenizer
from tba.tasks.arithmetic import ArithmeticTask


def build_builtin(name: str, task_cfg, path: Path, log=print, spec: TinySpec | None = None) -> Path:
    """The built-in model ``name`` of this arithmetic setting at ``path`` (:func:`builtin_location`'s):
    as it is when shipped or cached there, else warm-started (on ``spec``, default the model's own)
    and saved there."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"{name} is warm-started on the arithmetic task, not {task_cfg.name!r}")
    if path.parent == SHIPPED_DIR:  # checked by hash when the plan found it
        return path
    c = task_cfg
    if name == TOOL_MODEL:
        task = ArithmeticTask(c.digits, c.operators, c.eval_size, c.seed, c.terms)
        spec = spec or TOOL_SPEC
        return _cached(path, "tool demo model", spec, build_tool_tokenizer, warm_start_tools, task, log)
    task = ArithmeticTask(c.digits, c.operators, c.eval_size, c.seed, c.terms, c.show_work)
    return _cached(path, "demo model", spec or DEFAULT_SPEC, build_char_tokenizer, warm_start, task, log)


def ensure_tiny_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """The demo model of this arithmetic setting (``builtin:tiny-arithmetic``) on ``spec``: the shipped
    one (``use_shipped``), else built on first use and cached."""
    return _ensure("builtin:tiny-arithmetic", "tiny-arithmetic", task_cfg, cache_dir, spec, log, use_shipped)


def ensure_tiny_tool_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = TOOL_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """The tool demo model of this arithmetic setting (``builtin:tiny-tools``), likewise."""
    return _ensure(TOOL_MODEL, "tiny-tools", task_cfg, cache_dir, spec, log, use_shipped)


def _ensure(name: str, kind: str, task_cfg, cache_dir, spec: TinySpec, log, use_shipped: bool) -> Path:
    path = tiny_model_path(task_cfg, cache_dir, spec, kind=kind)
    found = shipped(path.name) if use_shipped else None
    return found or build_builtin(name, task_cfg, path, log, spec)


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
