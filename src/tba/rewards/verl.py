"""verl-style ``compute_score`` functions, one call per sample, wrapped into the batched convention."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from tba.rewards.base import _accepts_any, _callable_name, _parameters

# --------------------------------------------------------------------------------------------
# verl adapter


class _VerlScore:
    """A verl ``compute_score`` as a batched TRL-style function: one call per sample."""

    def __init__(self, compute_score: Callable[..., Any], kwargs: Mapping[str, Any]):
        self.compute_score = compute_score
        self.kwargs = dict(kwargs)
        self.__name__ = _callable_name(compute_score)
        params = _parameters(compute_score)
        self._names = None if params is None or _accepts_any(params) else set(params)
        call = type(compute_score).__call__  # an instance with an async __call__ counts too
        self.is_async = inspect.iscoroutinefunction(compute_score) or inspect.iscoroutinefunction(call)

    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns: list) -> Any:
        calls = [self._arguments(i, completion, columns) for i, completion in enumerate(completions)]
        if self.is_async:
            return self._score_concurrently(calls)  # a coroutine: the caller awaits it
        return [_verl_score(self.compute_score(**args)) for args in calls]

    async def _score_concurrently(self, calls: list[dict[str, Any]]) -> list[Any]:
        results = await asyncio.gather(*(self.compute_score(**args) for args in calls))
        return [_verl_score(r) for r in results]

    def _arguments(self, i: int, completion: Any, columns: Mapping[str, list]) -> dict[str, Any]:
        args = {
            "data_source": columns["data_source"][i] if "data_source" in columns else None,
            "solution_str": _completion_text(completion),
            "ground_truth": _ground_truth(columns, i),
            "extra_info": columns["extra_info"][i] if "extra_info" in columns else None,
            **self.kwargs,
        }
        return args if self._names is None else {k: v for k, v in args.items() if k in self._names}


def _verl_score(result: Any) -> Any:
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"compute_score returned a dict without 'score' (keys: {', '.join(map(str, result))})")
        return result["score"]
    return result


def _ground_truth(columns: Mapping[str, list], i: int) -> Any:
    if "ground_truth" in columns:
        return columns["ground_truth"][i]
    if "reward_model" not in columns:
        return None
    row = columns["reward_model"][i]
    if not isinstance(row, Mapping) or "ground_truth" not in row:
        raise ValueError(f"row {i}'s reward_model is {row!r}, not a dict with a 'ground_truth' key")
    return row["ground_truth"]


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content") or "")
    raise TypeError(f"completion {completion!r} is neither a string nor a list of chat messages")
