"""The demo models the package ships (``src/tba/demo_models``): where they are, their index with
each one's sha256 and held-out accuracy, and the check of a shipped folder against its hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from tba.demo.warm_start import TOOLS, greedy_accuracy, tool_accuracy
from tba.tasks import build_task

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "demo_models"
"""The warm-started models the package ships, one folder each, named as in the cache."""
SHIPPED_INDEX = SHIPPED_DIR / "shipped.json"
"""For each shipped folder: the sha256 of its ``model.safetensors``, the greedy accuracy it evaluates
at on its task's held-out problems, and the machine that built it."""


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


def shipped_accuracy(kind: str, path: Path, task_cfg) -> float:
    """Greedy accuracy of a demo model on its setting's held-out problems, as a run's first evaluation
    measures it (``eval/accuracy`` at step 0, the default ``generation.max_new_tokens``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = build_task(task_cfg)
    with torch.no_grad():
        if kind == "tiny-tools":
            return tool_accuracy(model, tokenizer, task, task.eval_prompts(), TOOLS)
        return greedy_accuracy(model, tokenizer, task, task.eval_prompts())
