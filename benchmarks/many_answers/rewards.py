"""Reward and answer of the many-answers task (``make_problems.py``): ``right`` is 1 when the reply's
answer follows the prompt's rule, else 0; :func:`answer` is the reply's answer in one canonical
form (``"42"``; ``"3+8"`` for a pair, smaller first), the unit in which the diversity study counts
distinct answers. A reply with no answer in it has none (``None``) and scores 0."""

from __future__ import annotations

import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def answer(text: str, kind: str) -> str | None:
    """The canonical answer of a reply to a prompt of ``kind``; None where it gives none."""
    numbers = re.findall(r"\d+", text)
    if kind == "multiple":
        return str(int(numbers[0])) if numbers else None
    if len(numbers) < 2:
        return None
    a, b = sorted(int(n) for n in numbers[:2])
    return f"{a}+{b}"


def is_right(ans: str | None, row: dict) -> bool:
    """Whether a canonical answer follows the rule of ``row`` (its ``kind`` and parameters)."""
    if ans is None:
        return False
    if row["kind"] == "multiple":
        n = int(ans)
        return row["lo"] <= n <= row["hi"] and n % row["d"] == 0
    a, b = (int(x) for x in ans.split("+"))
    return a <= 9 and b <= 9 and a + b == row["s"]


def first_number(completion: str) -> str | None:
    """A ``multiple`` reply's answer (``task.answer_func``): what the study counts distinct answers in."""
    return answer(_text(completion), "multiple")


def right(prompts, completions, completion_ids, kind, **columns):
    """1.0 where the reply's answer follows the rule, else 0.0 (tba's reward function form)."""
    out = []
    for i, c in enumerate(completions):
        row = {"kind": kind[i], **{k: v[i] for k, v in columns.items() if k in ("lo", "hi", "d", "s")}}
        out.append(1.0 if is_right(answer(_text(c), kind[i]), row) else 0.0)
    return out
