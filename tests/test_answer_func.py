"""``task.answer_func``: a dataset task's answer key, the unit that maj@k votes on and that
``eval/distinct_right`` counts; a function that raises on one completion gives it no answer."""

from __future__ import annotations

import json

from tba.config.task import DatasetTaskConfig
from tba.tasks import build_task

CODE = """
import re

def score(completions, **kwargs):
    return [1.0 for _ in completions]

def first_number(completion):
    if "boom" in completion:
        raise ValueError("no number in a boom")
    found = re.findall(r"\\d+", completion)
    return str(int(found[0])) if found else None
"""


def make(tmp_path, answer_func: str | None):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Name {i}"}) + "\n" for i in range(6)))
    (tmp_path / "code.py").write_text(CODE)
    cfg = DatasetTaskConfig(
        path=str(tmp_path / "data.jsonl"),
        reward_funcs=[f"{tmp_path / 'code.py'}:score"],
        answer_func=answer_func and f"{tmp_path / 'code.py'}:{answer_func}",
        eval_size=2,
    )
    said: list[str] = []
    return build_task(cfg, log=said.append), said


def test_answer_func_names_the_answer_and_a_raise_counts_as_none(tmp_path) -> None:
    task, said = make(tmp_path, "first_number")
    assert task.answer_key("It is 014, or 15.") == "14"
    assert task.answer_key("no digits") is None
    assert task.answer_key("boom") is None and task.answer_key("boom again") is None
    assert task.answer_errors == 2
    assert len(said) == 1 and "task.answer_func raised" in said[0] and "no number in a boom" in said[0]


def test_without_answer_func_the_key_is_the_stripped_text(tmp_path) -> None:
    task, _ = make(tmp_path, None)
    assert task.answer_key("  It is 14. ") == "It is 14."
    assert task.answer_key("   ") is None
