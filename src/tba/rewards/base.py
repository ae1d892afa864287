"""What a reward function is here: :class:`RewardFn`, the error its misconfiguration raises, the styles."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tba.errors import UserError

STANDARD_ARGS = ("prompts", "completions", "completion_ids")
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
STYLES = ("trl", "verl")
_FIX_VALUE = "return a finite float, or None for 'no opinion'"


class RewardFunctionError(UserError, ValueError):
    """A reward function is misconfigured; the message names it and says what to fix."""


@dataclass
class RewardFn:
    """One reward function, callable in the batched TRL convention.

    For verl-style functions ``fn`` is the batched wrapper and the config's extra keyword
    arguments are already bound into it (``kwargs`` is then empty).
    """

    name: str  # unique across the list: it keys the metrics and the error log
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    spec: str = ""  # the config string it came from

    @property
    def label(self) -> str:
        """How messages name it: ``'name' (spec)``."""
        return f"'{self.name}' ({self.spec})" if self.spec and self.spec != self.name else f"'{self.name}'"


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    name = name or type(fn).__name__
    # it becomes a metric key (reward/<name>_mean): a lambda's "<lambda>" must not leak into it
    return re.sub(r"\W", "_", name).strip("_") or "reward"


def _parameters(fn: Any) -> dict[str, inspect.Parameter] | None:
    """The parameters of ``fn``, or None when it cannot be inspected (then everything is passed)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _accepts_any(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _required(params: dict[str, inspect.Parameter]) -> list[str]:
    keywordable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params.values() if p.kind in keywordable and p.default is inspect.Parameter.empty]
