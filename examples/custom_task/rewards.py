"""Reward functions for the custom-task example, in TRL's convention.

Each is called on a batch: ``prompts`` and ``completions`` are lists of strings, and every other
column of ``problems.jsonl`` (here ``answer`` and ``op``) arrives as a keyword argument holding
one value per completion. Return one float per completion, or None for "no opinion".
"""


def _as_int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def exact(prompts, completions, completion_ids, answer, **kwargs):
    """1 for the right number, else 0."""
    return [1.0 if _as_int(c) == int(a) else 0.0 for c, a in zip(completions, answer)]


def closeness(completions, answer, scale=20, **kwargs):
    """Partial credit for near misses: 1 at the answer, 0 at `scale` or more away.
    No opinion (None) on a completion that is not a number: `exact` already gives it 0."""
    out = []
    for c, a in zip(completions, answer):
        guess = _as_int(c)
        out.append(None if guess is None else max(0.0, 1.0 - abs(guess - int(a)) / scale))
    return out


def answer(completion: str) -> str | None:
    """The number a completion gives, as maj@k and ``eval/distinct_right`` see it (``task.answer_func``)."""
    guess = _as_int(completion)
    return None if guess is None else str(guess)
