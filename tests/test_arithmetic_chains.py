"""The arithmetic task's longer setting: chains of operations whose completions show their work."""

from __future__ import annotations

import random

import pytest

from tba.config import ConfigError, load_config
from tba.demo import shipped_index, tiny_model_path
from tba.tasks import build_task
from tba.tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def test_chains_are_computed_left_to_right_with_their_worked_solution():
    task = ArithmeticTask(digits=1, eval_size=50, terms=5, show_work=True)
    prompt = task._prompt((7, "+", 0, "+", 9, "-", 1, "-", 5))
    assert prompt.text == "7+0+9-1-5="
    assert prompt.columns["solution"] == "7+0=7 7+9=16 16-1=15 15-5=10" and prompt.answer == "10"
    assert task.target(prompt) == "7+0=7 7+9=16 16-1=15 15-5=10"
    negative = task._prompt((1, "-", 8, "-", 2, "+", 0, "+", 3))
    assert negative.columns["solution"] == "1-8=-7 -7-2=-9 -9+0=-9 -9+3=-6" and negative.answer == "-6"
    # every completion fits the bound the warm start generates up to
    rng = random.Random(0)
    assert max(len(task.target(p)) for p in task.sample_prompts(2000, rng)) <= task.max_answer_tokens
    lengths = [len(task.target(p)) + 1 for p in task.eval_prompts()]  # + EOS
    assert 20 <= min(lengths) and max(lengths) <= 40


def test_the_reward_reads_the_number_after_the_last_equals_sign():
    task = ArithmeticTask(digits=1, eval_size=50, terms=3, show_work=True)
    p = task._prompt((2, "+", 3, "-", 4))
    assert task.reward(p, "2+3=5 5-4=1") == 1.0
    assert task.reward(p, " 2+3=5 5-4=1 ") == 1.0
    assert task.reward(p, "2+3=6 6-4=1") == 1.0  # the final answer counts, as in GSM8K
    assert task.reward(p, "2+3=5 5-4=2") == 0.0
    assert task.reward(p, "1") == 0.0  # no worked step, no '='
    assert task.reward(p, "2+3=5 5-4=") == 0.0
    plain = ArithmeticTask(digits=1, eval_size=50, terms=3)
    assert plain.reward(plain._prompt((2, "+", 3, "-", 4)), "1") == 1.0 and plain.target(p) == "2+3=5 5-4=1"


def test_two_terms_keep_the_demo_splits_and_its_model_cache():
    cfg = load_config(None, [])
    task = build_task(cfg.task)
    assert [p.text for p in task.eval_prompts()[:3]] == ["99-14=", "0+74=", "4+12="]
    # the demo's setting keeps its model's name (the chain settings at their defaults are left out of
    # the key): the name of the shipped model, warm-started by the recipe of TinySpec version 5
    assert tiny_model_path(cfg.task).name == "tiny-arithmetic-e7a86609981a"
    assert tiny_model_path(cfg.task).name in shipped_index()
    chained = load_config(None, ["--task.terms=5", "--task.digits=1", "--task.show_work=true"]).task
    assert tiny_model_path(chained) != tiny_model_path(cfg.task)


def test_chains_with_products_are_refused():
    with pytest.raises(ConfigError, match="operators '\\+-' with chains"):
        load_config(None, ["--task.terms=3", "--task.operators=+*"])
