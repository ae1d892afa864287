"""The demo models the package ships (``src/tba/demo_models``): where they are, their index with
each one's sha256 and held-out accuracy, and the check of a shipped folder against its hash."""

from __future__ import annotations

from pathlib import Path

import torch

from tba.demo.warm_start import TOOLS, greedy_accuracy, tool_accuracy
from tba.models.builtin import SHIPPED_DIR, SHIPPED_INDEX, SHIPPED_SETTINGS, file_sha256, shipped, shipped_index  # noqa: F401
from tba.tasks import build_task


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
