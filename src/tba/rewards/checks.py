"""The dry run before a run starts: each reward function called on a few dataset rows, its problems said at once."""

from __future__ import annotations

from tba.rewards.base import _FIX_VALUE, STANDARD_ARGS, RewardFn, RewardFunctionError, _parameters, _required
from tba.rewards.calling import _as_list, _as_reward, _BadValue, _Batch, _call, _make_batch
from tba.rewards.loading import _never_supplied
from tba.rewards.verl import _VerlScore
from tba.user_code import describe_exception

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
