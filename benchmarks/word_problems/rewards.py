"""Rewards of the word-problem task: ``number`` 1 for the right first number, ``brief`` 0.5 for
an answer of at most three words (the task of issue 36's measurements: reward = number + brief)."""

import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def number(prompts, completions, completion_ids, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = re.search(r"-?\d+", _text(c))
        out.append(1.0 if m and int(m.group()) == int(a) else 0.0)
    return out


def brief(prompts, completions, completion_ids, **kwargs):
    return [0.5 if 0 < len(_text(c).split()) <= 3 else 0.0 for c in completions]
