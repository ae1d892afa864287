"""Calling reward functions on a batch safely: per-sample failures counted and skipped, values checked."""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tba.rewards.base import _FIX_VALUE, STANDARD_ARGS, RewardFn, _accepts_any, _parameters
from tba.rewards.stats import RewardStats, _Failure
from tba.user_code import resolve

# --------------------------------------------------------------------------------------------
# Calling


@dataclass
class _Batch:
    prompts: list
    completions: list
    completion_ids: list
    columns: dict[str, list]

    def __len__(self) -> int:
        return len(self.completions)

    def row(self, i: int) -> _Batch:
        cols = {k: v[i : i + 1] for k, v in self.columns.items()}
        return _Batch(self.prompts[i : i + 1], self.completions[i : i + 1], self.completion_ids[i : i + 1], cols)


def _make_batch(prompts: list, completions: list, completion_ids: list, columns: Mapping[str, list]) -> _Batch:
    """Check the caller's lengths (a mismatch is a bug of the caller, not of a reward function)."""
    n = len(completions)
    lengths = {"prompts": len(prompts), "completion_ids": len(completion_ids)}
    lengths.update({f"column {k!r}": len(v) for k, v in columns.items()})
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"reward inputs must have one entry per completion ({n}); got {wrong}")
    cols = {k: list(v) for k, v in columns.items() if k not in STANDARD_ARGS}
    return _Batch(list(prompts), list(completions), list(completion_ids), cols)


def _call(rf: RewardFn, batch: _Batch) -> Any:
    # Fresh lists per call: a function that mutates its arguments must not change what the next one sees.
    supplied = {k: list(v) for k, v in batch.columns.items()}
    supplied.update(rf.kwargs)
    supplied.update(
        prompts=list(batch.prompts), completions=list(batch.completions), completion_ids=list(batch.completion_ids)
    )
    params = _parameters(rf.fn)
    if params is not None and not _accepts_any(params):
        supplied = {k: v for k, v in supplied.items() if k in params}
    return resolve(rf.fn(**supplied))


class _BadValue(Exception):
    def __init__(self, message: str, non_finite: bool = False):
        super().__init__(message)
        self.non_finite = non_finite


def _as_list(raw: Any, n: int) -> list:
    if getattr(raw, "ndim", None) == 1 and hasattr(raw, "tolist"):  # a numpy array or tensor of rewards
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        raise _BadValue(
            f"returned {_short(raw)} ({type(raw).__name__}) instead of a list with one reward per completion"
        )
    if len(raw) != n:
        raise _BadValue(f"returned {len(raw)} values for {n} completions; return one reward per completion")
    return list(raw)


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()  # numpy bool_, 0-d arrays and tensors
    if not isinstance(value, numbers.Real):
        raise _BadValue(f"returned {_short(value)} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:
        raise _BadValue(f"returned {_short(value)}, too large for a float", non_finite=True) from None
    if not math.isfinite(number):
        raise _BadValue(f"returned {number}", non_finite=True)
    return number


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compute_rewards(
    fns: list[RewardFn],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    stats: RewardStats,
) -> list[float | None]:
    """One combined reward per sample, None for skipped ones; never raises because of a reward function."""
    batch = _make_batch(prompts, completions, completion_ids, columns)
    n = len(batch)
    totals: list[float | None] = [None] * n
    failed = [False] * n
    stats.last_means = {}
    for rf in fns:
        values = []
        for i, outcome in enumerate(_evaluate(rf, batch) if n else []):
            if isinstance(outcome, _Failure):
                stats._record(rf, outcome)
                failed[i] = True
            elif outcome is not None:
                values.append(outcome)
                totals[i] = (0.0 if totals[i] is None else totals[i]) + rf.weight * outcome
        if values:
            stats.last_means[rf.name] = sum(values) / len(values)
    stats.no_reward += sum(1 for t, f in zip(totals, failed, strict=True) if t is None and not f)
    return [None if f else t for t, f in zip(totals, failed, strict=True)]


def _evaluate(rf: RewardFn, batch: _Batch) -> list[float | None | _Failure]:
    """One function on the whole batch; if that raises, on each sample alone to find the bad ones."""
    n = len(batch)
    try:
        raw = _call(rf, batch)
    except Exception as exc:
        if n == 1:
            return [_Failure("raised on completion 0 of 1:", _traceback_text(exc))]
        return [_evaluate_alone(rf, batch, i) for i in range(n)]
    return _outcomes(raw, list(range(n)), n)


def _evaluate_alone(rf: RewardFn, batch: _Batch, i: int) -> float | None | _Failure:
    try:
        raw = _call(rf, batch.row(i))
    except Exception as exc:
        return _Failure(f"raised on completion {i} of {len(batch)}:", _traceback_text(exc))
    return _outcomes(raw, [i], len(batch))[0]


def _outcomes(raw: Any, indices: list[int], total: int) -> list[float | None | _Failure]:
    """Validate a result for the samples ``indices`` (of a batch of ``total``)."""
    try:
        items = _as_list(raw, len(indices))
    except _BadValue as bad:
        failure = _Failure(f"{bad}; all {len(indices)} completions of the batch are skipped")
        return [failure] * len(indices)
    except Exception as exc:  # a result object whose tolist() or len() fails
        return [_Failure("returned a result that cannot be read as a list:", _traceback_text(exc))] * len(indices)
    out: list[float | None | _Failure] = []
    for i, item in zip(indices, items, strict=True):
        try:
            out.append(_as_reward(item))
        except _BadValue as bad:
            out.append(_Failure(f"{bad} for completion {i} of {total}; {_FIX_VALUE}", non_finite=bad.non_finite))
        except Exception as exc:  # a number-like object that fails to convert
            out.append(_Failure(f"returned an unreadable value for completion {i} of {total}:", _traceback_text(exc)))
    return out


# --------------------------------------------------------------------------------------------
# Exception text


def _traceback_text(exc: BaseException) -> str:
    """The traceback from the user's code on: this module's own frames above it are noise."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, f in enumerate(frames) if f.filename == _call.__code__.co_filename]
    start = min(ours[-1] + 1, len(frames) - 1) if ours else 0
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames[start:])]
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()
