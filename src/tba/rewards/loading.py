"""Loading reward functions from config strings and checking their signatures against what they will be given."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tba.rewards.base import (
    STANDARD_ARGS,
    STYLES,
    VERL_ARGS,
    RewardFn,
    RewardFunctionError,
    _accepts_any,
    _callable_name,
    _parameters,
    _required,
)
from tba.rewards.verl import _VerlScore
from tba.user_code import load_object, split_spec

# --------------------------------------------------------------------------------------------
# Loading


def load_reward_functions(
    specs: list[str],
    weights: list[float] | None = None,
    kwargs: dict | list[dict] | None = None,
    style: str = "trl",
    base_dir: str | Path | None = None,
) -> list[RewardFn]:
    """Load reward functions from config strings (see the module docstring for the forms)."""
    if isinstance(specs, str):  # one spec given bare; iterating it would load single characters
        specs = [specs]
    if not specs:
        raise RewardFunctionError("no reward functions given: set task.reward_funcs to 'pkg.module:fn' entries")
    if style not in STYLES:
        raise RewardFunctionError(
            f"unknown reward function style {style!r}; use 'trl' (batched) or 'verl' (per sample)"
        )
    weights = _per_function_weights(weights, len(specs))
    extras = _per_function_kwargs(kwargs, len(specs))
    base = Path(base_dir).expanduser() if base_dir is not None else Path.cwd()
    taken: set[str] = set()
    out = []
    for spec, weight, extra in zip(specs, weights, extras, strict=True):
        target = _load_target(spec, base)
        if style == "verl":
            _check_verl_signature(spec, target, extra)
            fn, extra = _VerlScore(target, extra), {}
        else:
            _check_trl_signature(spec, target, extra)
            fn = target
        name = _unique_name(_callable_name(target), taken)
        out.append(RewardFn(name=name, fn=fn, weight=weight, kwargs=extra, spec=spec))
    return out


def make_reward_fn(name: str, fn: Callable[..., Any], weight: float = 1.0) -> RewardFn:
    """Wrap a built-in task's own batched reward function."""
    return RewardFn(name=name, fn=fn, weight=float(weight), spec=name)


def _per_function_weights(weights: list[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise RewardFunctionError(
            f"task.reward_weights has {len(weights)} entries for {n} task.reward_funcs; give one weight per function"
        )
    out = [float(w) for w in weights]
    if not all(math.isfinite(w) for w in out):
        raise RewardFunctionError(f"task.reward_weights must be finite numbers, got {weights}")
    return out


def _per_function_kwargs(kwargs: dict | list[dict] | None, n: int) -> list[dict[str, Any]]:
    if kwargs is None:
        return [{} for _ in range(n)]
    if isinstance(kwargs, Mapping):
        return [dict(kwargs) for _ in range(n)]
    if len(kwargs) != n:
        raise RewardFunctionError(
            f"task.reward_kwargs has {len(kwargs)} entries for {n} task.reward_funcs; "
            "give one dict per function, or a single dict for all of them"
        )
    return [dict(k or {}) for k in kwargs]


def _load_target(spec: str, base: Path) -> Callable[..., Any]:
    target = load_object(spec, "reward function", RewardFunctionError, base)
    if inspect.isclass(target) or not callable(target):
        kind = "a class" if inspect.isclass(target) else f"a {type(target).__name__}, not callable"
        _, attr = split_spec(spec, "reward function", RewardFunctionError)
        raise RewardFunctionError(
            f"reward function {spec!r}: {attr!r} is {kind}; point the spec at a function (or at an instance)"
        )
    return target


def _unique_name(base: str, taken: set[str]) -> str:
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


# --------------------------------------------------------------------------------------------
# Signatures


def _signature_problems(fn: Any, extra: Mapping[str, Any], reserved: tuple[str, ...], how: str) -> list[str]:
    """What about ``fn``'s signature can be checked without the dataset's columns."""
    params = _parameters(fn)
    if params is None:
        return []
    problems = [
        f"parameter {p.name!r} is positional-only, but reward functions are called with keyword arguments "
        f"({how}); remove the '/' from its signature"
        for p in params.values()
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    for key in extra:
        if key in reserved:
            problems.append(f"task.reward_kwargs sets {key!r}, which the caller supplies; remove it")
        elif key not in params and not _accepts_any(params):
            problems.append(
                f"task.reward_kwargs sets {key!r}, which is not a parameter of the function "
                f"(its parameters: {', '.join(params) or 'none'}); fix the key or add the parameter"
            )
    return problems


def _check_trl_signature(spec: str, fn: Any, extra: Mapping[str, Any]) -> None:
    how = "prompts=..., completions=..., completion_ids=..., <column>=..."
    problems = _signature_problems(fn, extra, STANDARD_ARGS, how)
    if problems:
        raise RewardFunctionError(f"reward function {spec!r}: " + "; ".join(problems))


def _check_verl_signature(spec: str, fn: Any, extra: Mapping[str, Any]) -> None:
    how = "data_source=..., solution_str=..., ground_truth=..., extra_info=..."
    problems = _signature_problems(fn, extra, VERL_ARGS, how)
    params = _parameters(fn)
    if params is not None:
        supplied = set(VERL_ARGS) | set(extra)
        what = "the verl arguments and task.reward_kwargs keys"
        problems += [_never_supplied(name, supplied, what) for name in _required(params) if name not in supplied]
    if problems:
        raise RewardFunctionError(f"reward function {spec!r} (verl style): " + "; ".join(problems))


def _never_supplied(name: str, supplied: set[str], what: str) -> str:
    close = difflib.get_close_matches(name, sorted(supplied), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"it requires parameter {name!r}{hint}, which is never supplied: the arguments are {what} "
        f"({', '.join(sorted(supplied))}); rename the parameter to one of these, give it a default, "
        "or set it in task.reward_kwargs"
    )
