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

The package: :mod:`~tba.rewards.base` (what a reward function is), :mod:`~tba.rewards.loading`,
:mod:`~tba.rewards.verl`, :mod:`~tba.rewards.checks` (the dry run), :mod:`~tba.rewards.calling`
and :mod:`~tba.rewards.stats`.
"""

from tba.rewards.base import STANDARD_ARGS, STYLES, VERL_ARGS, RewardFn, RewardFunctionError
from tba.rewards.calling import compute_rewards
from tba.rewards.checks import check_reward_functions
from tba.rewards.loading import load_reward_functions, make_reward_fn
from tba.rewards.stats import RewardStats

__all__ = [
    "STANDARD_ARGS",
    "STYLES",
    "VERL_ARGS",
    "RewardFn",
    "RewardFunctionError",
    "RewardStats",
    "check_reward_functions",
    "compute_rewards",
    "load_reward_functions",
    "make_reward_fn",
]
