"""The built-in demo models (``model.policy: builtin:tiny-arithmetic``, ``builtin:tiny-tools``): the tiny Llama of
:mod:`tba.models.tiny`, warm-started on arithmetic so that reinforcement learning starts from
partial accuracy.

``ensure_tiny_model(task_cfg)`` returns a local directory holding an ordinary Hugging Face
checkpoint (``config.json``, ``model.safetensors``, tokenizer files) that ``from_pretrained``
loads like any other. The package ships the default settings' models (:data:`SHIPPED_DIR`, built
by ``python -m tba.demo``, i.e. ``make demo-models``) and checks their weights against the sha256
recorded beside them on every load, so every machine starts the demo from the same weights. Other
settings are built once and cached under ``$TBA_CACHE`` (default ``~/.cache/tba``).

The warm start is supervised next-token training on ``problem=answer<eos>`` strings from the
task's training split, stopped as soon as greedy accuracy on a validation sample of that split,
averaged over the last ``smooth_checks`` checks, reaches ``target_accuracy`` (so the RL demo has
room to improve, whatever the machine's speed). Single checks jump by 10 points between steps;
stopping at the first one over the target made each CPU's float rounding pick another spike and
another model, whose RL gain differed by 10-15 points. The smoothed criterion makes a rebuild land
in the same regime; only the shipped weights make it the same model (another CPU's rounding still
sends 800 steps of SGD along another path).

:mod:`.warm_start` warm-starts, :mod:`.index` holds the shipped models' index and hashes,
:mod:`.builtin` finds or builds a built-in model by name, and ``python -m tba.demo`` rebuilds the
shipped ones.
"""

from tba.demo.builtin import (
    BUILTIN_PREFIX,
    TOOL_MODEL,
    cache_root,
    ensure_tiny_model,
    ensure_tiny_tool_model,
    tiny_model_path,
)
from tba.demo.index import SHIPPED_DIR, SHIPPED_SETTINGS, file_sha256, shipped, shipped_accuracy, shipped_index
from tba.demo.warm_start import (
    TOOL_SPEC,
    TOOL_TRAJECTORY_TOKENS,
    TOOLS,
    greedy_accuracy,
    tool_trace,
    warm_start,
    warm_start_tools,
)

__all__ = [
    "BUILTIN_PREFIX",
    "SHIPPED_DIR",
    "SHIPPED_SETTINGS",
    "TOOLS",
    "TOOL_MODEL",
    "TOOL_SPEC",
    "TOOL_TRAJECTORY_TOKENS",
    "cache_root",
    "ensure_tiny_model",
    "ensure_tiny_tool_model",
    "file_sha256",
    "greedy_accuracy",
    "shipped",
    "shipped_accuracy",
    "shipped_index",
    "tiny_model_path",
    "tool_trace",
    "warm_start",
    "warm_start_tools",
]
