"""User reward functions: loaded from config strings, checked before a run, called safely on batches.

Naming a function
    ``"pkg.module:fn"`` or ``"path/to/file.py:fn"``, as all user code is named
    (:mod:`tba.user_code`), relative to ``base_dir`` (default: the current directory).

Calling convention (TRL's), once per batch::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

    ``prompts`` are strings or chat message lists, ``completions`` strings or message lists
    (``[{"role": "assistant", "content": ...}]``), ``completion_ids`` lists of token ids, and every
    other dataset column arrives as a keyword argument: a list with one value per sample. Columns
    named like the three standard arguments are not passed. Extra keyword arguments from config
    (``task.reward_kwargs``) override columns of the same name. A function without ``**kwargs``
    receives only the arguments it names. ``async def`` functions are awaited
    (:func:`tba.user_code.resolve`). An item ``None`` means "no opinion" on that sample. ``bool``
    and numpy scalars count as numbers (True is 1.0); a 1-D array is accepted in place of a list.

verl style (``style="verl"``)
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` is called
    once per sample with the completion text as ``solution_str`` (the last message's content for a
    chat completion), ``data_source`` and ``extra_info`` from the columns of those names (None when
    absent) and ``ground_truth`` from the ``ground_truth`` column, else from the ``reward_model``
    column's ``["ground_truth"]``. A dict result gives its ``"score"``. It is wrapped into a batched
    function, so everything downstream sees one convention.

Failures
    Configuration problems raise :class:`RewardFunctionError` at load time or in the dry run
    (:func:`check_reward_functions`), before any model is loaded. During a run
    :func:`compute_rewards` never raises because of a reward function: a sample that a function
    fails on (it raises, returns something that is not a finite number, or the batch result has
    the wrong length) is counted in :class:`RewardStats` and skipped, i.e. gets reward None even if
    other functions scored it, so that a reward never silently lacks a component. The combined
    reward is the weighted sum of the functions' non-None values; a sample that every function
    answered None for gets None too and is counted as ``no_reward``.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import math
import numbers
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tba.errors import UserError
from tba.user_code import describe_exception, load_object, resolve, split_spec

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


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    name = name or type(fn).__name__
    # it becomes a metric key (reward/<name>_mean): a lambda's "<lambda>" must not leak into it
    return re.sub(r"\W", "_", name).strip("_") or "reward"


def _unique_name(base: str, taken: set[str]) -> str:
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


# --------------------------------------------------------------------------------------------
# Signatures


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


# --------------------------------------------------------------------------------------------
# The dry run


def check_reward_functions(
    fns: list[RewardFn], prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list]
) -> None:
    """Dry run before any model is loaded: check each function's signature against the arguments
    it will get, call it on these rows, and check what it returns. Raises RewardFunctionError
    naming every function that fails and what to fix."""
    batch = _make_batch(prompts, completions, completion_ids, columns)
    names = [rf.name for rf in fns]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RewardFunctionError(f"several reward functions are named {', '.join(duplicates)}; names must be unique")
    problems = []
    for rf in fns:
        problem = _signature_problem(rf, batch) or _dry_run_problem(rf, batch)
        if problem:
            problems.append(f"reward function {rf.label}: {problem}")
    if problems:
        raise RewardFunctionError("\n".join(problems))


def _signature_problem(rf: RewardFn, batch: _Batch) -> str | None:
    if isinstance(rf.fn, _VerlScore):
        return _verl_columns_problem(rf.fn, batch)
    params = _parameters(rf.fn)
    if params is None:
        return None
    supplied = set(STANDARD_ARGS) | set(batch.columns) | set(rf.kwargs)
    missing = [name for name in _required(params) if name not in supplied]
    if not missing:
        return None
    what = "prompts, completions, completion_ids, the dataset columns and task.reward_kwargs keys"
    return _never_supplied(missing[0], supplied, what)


def _verl_columns_problem(fn: _VerlScore, batch: _Batch) -> str | None:
    wants_truth = fn._names is None or "ground_truth" in fn._names
    if wants_truth and "ground_truth" not in batch.columns and "reward_model" not in batch.columns:
        return (
            "verl-style compute_score needs the reference answer, but the dataset has neither a 'ground_truth' "
            f"column nor a 'reward_model' column (columns: {', '.join(batch.columns) or 'none'}); add one"
        )
    return None


def _dry_run_problem(rf: RewardFn, batch: _Batch) -> str | None:
    n = len(batch)
    try:
        raw = _call(rf, batch)
    except Exception as exc:
        return (
            f"raised {describe_exception(exc)} when called on {n} dataset rows with dummy completions; "
            "make it handle any completion (return None for 'no opinion')"
        )
    try:
        items = _as_list(raw, n)
    except _BadValue as bad:
        return str(bad)
    for i, item in enumerate(items):
        try:
            _as_reward(item)
        except _BadValue as bad:
            return f"{bad} for completion {i}; {_FIX_VALUE}"
    return None


# --------------------------------------------------------------------------------------------
# During a run


@dataclass
class _Failure:
    what: str  # "raised on completion 3 of 8", "returned nan for completion 3 of 8", ...
    details: str = ""  # traceback text, for exceptions
    non_finite: bool = False


@dataclass
class RewardStats:
    """Cumulative reward counters of one searcher."""

    errors: int = 0  # failed (function, sample) evaluations of any kind
    non_finite: int = 0  # the subset that returned NaN or inf
    no_reward: int = 0  # samples every function answered None for (dropped, not given 0)
    last_means: dict[str, float] = field(default_factory=dict)  # per function, over the latest batch
    reported: set[str] = field(default_factory=set, repr=False)  # functions whose first failure is recorded
    # (function, its first failure) not yet taken
    unreported: list[tuple[str, str]] = field(default_factory=list, repr=False)

    def _record(self, rf: RewardFn, failure: _Failure) -> None:
        self.errors += 1
        self.non_finite += failure.non_finite
        if rf.name not in self.reported:  # later failures of a function are only counted
            self.reported.add(rf.name)
            details = f"\n{failure.details}" if failure.details else ""
            self.unreported.append((rf.name, f"reward function {rf.label} {failure.what}{details}"))

    def metrics(self) -> dict[str, float]:
        out = {
            "searcher/reward_errors": float(self.errors),
            "searcher/reward_non_finite": float(self.non_finite),
            "searcher/no_reward": float(self.no_reward),
        }
        out.update({f"reward/{name}_mean": mean for name, mean in self.last_means.items()})
        return out

    def take_new_errors(self) -> list[str]:
        """The first failure of each function (header line + traceback), each returned once."""
        out, self.unreported = self.unreported, []
        return [text for _, text in out]

    def fork(self) -> RewardStats:
        """Empty counters for one call on a scoring thread, knowing which functions have already
        reported their first failure; :meth:`merge` adds them back."""
        return RewardStats(reported=set(self.reported))

    def merge(self, other: RewardStats) -> None:
        """Add the counts of a :meth:`fork`; a first failure two calls both saw is kept once."""
        self.errors += other.errors
        self.non_finite += other.non_finite
        self.no_reward += other.no_reward
        if other.last_means:
            self.last_means = dict(other.last_means)
        for name, text in other.unreported:
            if name not in self.reported:
                self.reported.add(name)
                self.unreported.append((name, text))


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
