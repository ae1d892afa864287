"""The built-in models by name (``builtin:tiny-arithmetic``, ``builtin:tiny-tools``), where each
loads from, and their shapes, without loading or building anything: the run plan reads this
(:func:`builtin_location`), :mod:`tba.demo` builds the models there. A shipped folder
(``src/tba/demo_models``) is checked against the sha256 of its index before it is named."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
TOOL_MODEL = "builtin:tiny-tools"


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 64
    # warm start
    batch_size: int = 64
    lr: float = 1e-3
    max_steps: int = 3000
    check_every: int = 25
    target_accuracy: float = 0.3
    smooth_checks: int = 3  # stop when the mean of this many last checks reaches target_accuracy
    validation_size: int = 256
    seed: int = 0
    version: int = 5  # bump when the recipe changes so caches are rebuilt


DEFAULT_SPEC = TinySpec()
"""The demo model's shape and warm start."""
TOOL_SPEC = TinySpec(max_positions=96, lr=3e-4, check_every=2, target_accuracy=0.3, validation_size=128, version=2)
"""The tool demo model: the demo's shape over the tool tokenizer, warm-started on calculator traces
until it solves 30% of validation problems with the tool (the mean of the last three checks, two
steps apart: accuracy jumps within a few steps once the model starts calling the tool)."""

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "demo_models"
"""The warm-started models the package ships, one folder each, named as in the cache."""
SHIPPED_INDEX = SHIPPED_DIR / "shipped.json"
"""For each shipped folder: the sha256 of its ``model.safetensors``, the greedy accuracy it evaluates
at on its task's held-out problems, and the machine that built it."""

MULTI_TURN_SETTINGS = (
    "tools",
    "environment",
    "environment_args",
    "max_turns",
    "max_trajectory_tokens",
    "tool_timeout",
    "agent",
    "agent_args",
    "agent_timeout",
    "system_prompt",
    "environment_workers",
)
"""Task settings about how rollouts run, not what the model learns: no part of a cache key."""


def shipped_index() -> dict:
    return json.loads(SHIPPED_INDEX.read_text()) if SHIPPED_INDEX.is_file() else {}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped(name: str) -> Path | None:
    """The shipped model folder called ``name`` (``tiny-arithmetic-<setting hash>``) after checking
    its weights against their recorded hash; None if the package ships none of that name."""
    entry = shipped_index().get(name)
    if entry is None:
        return None
    path = SHIPPED_DIR / name
    weights = path / "model.safetensors"
    if not weights.is_file() or file_sha256(weights) != entry["sha256"]:
        raise RuntimeError(
            f"the shipped demo model {path} is missing or damaged (its weights do not match the sha256 "
            f"{entry['sha256'][:12]}... recorded in {SHIPPED_INDEX.name}); reinstall tba, or rebuild the shipped "
            "models with `make demo-models`"
        )
    return path


SHIPPED_SETTINGS = {"tiny-arithmetic": {}, "tiny-tools": {"digits": 3, "operators": "*"}}
"""The arithmetic settings whose models the package ships: the demo's (``tba train``,
``configs/custom_task.yaml``) and the tool demo's (``configs/tools.yaml``)."""


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


def builtin_location(name: str, task_cfg, cache_dir: str | None = None) -> Path:
    """Where the built-in model ``name`` of this arithmetic setting loads from, building nothing: the
    folder the package ships (its weights checked by hash), else its cache folder (built or not yet).
    The run plan's path of it; :func:`build_builtin` builds it there."""
    spec, kind = (TOOL_SPEC, "tiny-tools") if name == TOOL_MODEL else (DEFAULT_SPEC, "tiny-arithmetic")
    path = tiny_model_path(task_cfg, cache_dir, spec, kind=kind)
    return shipped(path.name) or path
