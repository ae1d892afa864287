"""Dataset-backed tasks: every local format through the real ``datasets`` loader, held-out
evaluation rows, stable prompt ids, the prompt-length filter, verl-style parquet, GSM8K."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
from tests.helpers.datasets import GSM8K_ROWS
from tests.helpers.tiny_bpe import IM_END, build_bpe_tokenizer

from tba.config import DatasetTaskConfig, GSM8KTaskConfig
from tba.models.loading import encode_prompts, eos_ids
from tba.rewards import RewardFunctionError, RewardStats
from tba.tasks import build_task
from tba.tasks.data import DatasetLoadError

ROWS = [{"prompt": f"What is {a} plus {a + 1}?", "target": 2 * a + 1, "topic": "sums"} for a in range(40)]

REWARD_MODULE = """
def exact(prompts, completions, completion_ids, target, **kwargs):
    return [1.0 if c.strip() == str(t) else 0.0 for c, t in zip(completions, target)]

def has_digit(completions, **kwargs):
    return [None if c.startswith("?") else float(any(ch.isdigit() for ch in c)) for c in completions]

def chat_exact(prompts, completions, ground_truth, **kwargs):
    # conversational: completions are message lists
    return [1.0 if c[0]["content"].strip() == str(g) else 0.0 for c, g in zip(completions, ground_truth)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    return path


def write(tmp_path, fmt: str, rows=ROWS):
    df = pd.DataFrame(rows)
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path)
    return path


def dataset_cfg(path, reward_file, fn="exact", **kw) -> DatasetTaskConfig:
    return DatasetTaskConfig(path=str(path), reward_funcs=[f"{reward_file}:{fn}"], eval_size=8, **kw)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_local_format_loads_and_rewards(tmp_path, reward_file, fmt):
    task = build_task(dataset_cfg(write(tmp_path, fmt), reward_file))
    assert task.num_train == 32 and len(task.eval_prompts()) == 8
    p = task.sample_prompts(1, random.Random(0))[0]
    assert p.text.startswith("What is") and not p.is_chat
    assert p.columns["topic"] == "sums" and int(p.columns["target"]) == 2 * int(p.text.split()[2]) + 1
    stats = RewardStats()
    right = str(p.columns["target"])
    assert task.rewards([p, p], [right, "nope"], [[1], [2]], stats) == [1.0, 0.0]
    assert stats.errors == 0


def test_eval_rows_are_held_out_stable_and_ids_are_hashes(tmp_path, reward_file):
    cfg = dataset_cfg(write(tmp_path, "jsonl"), reward_file)
    a, b = build_task(cfg), build_task(cfg)
    held = [p.id for p in a.eval_prompts()]
    assert held == [p.id for p in b.eval_prompts()]  # same rows, same order, same ids in every process
    seen = {p.id for p in a.sample_prompts(200, random.Random(1))}
    assert len(seen) == 32 and not seen & set(held)  # every training prompt, never an eval one
    other = build_task(cfg.model_copy(update={"seed": 7}))
    assert {p.id for p in other.eval_prompts()} != set(held)
    # an epoch visits each training prompt once before any repeats
    first_epoch = [p.id for p in build_task(cfg).sample_prompts(32, random.Random(3))]
    assert len(set(first_epoch)) == 32


def test_id_column_and_duplicates_of_eval_prompts_are_not_trained(tmp_path, reward_file):
    rows = [dict(r, uid=f"q{i}") for i, r in enumerate(ROWS)]
    task = build_task(dataset_cfg(write(tmp_path, "jsonl", rows), reward_file, id_column="uid"))
    assert all(p.id.startswith("q") for p in task.eval_prompts())
    dup = ROWS + [ROWS[0]] * 5  # a prompt repeated: if it is held out, its copies must not be trained
    path = write(tmp_path, "csv", dup)
    for seed in range(5):
        t = build_task(dataset_cfg(path, reward_file, seed=seed))
        held = {p.id for p in t.eval_prompts()}
        assert not held & {p.id for p in t.sample_prompts(100, random.Random(0))}


def test_eval_split_from_a_folder(tmp_path, reward_file):
    folder = tmp_path / "ds"
    folder.mkdir()
    pd.DataFrame(ROWS[:30]).to_json(folder / "train.jsonl", orient="records", lines=True)
    pd.DataFrame(ROWS[30:]).to_json(folder / "test.jsonl", orient="records", lines=True)
    task = build_task(dataset_cfg(folder, reward_file, eval_split="test"))
    assert task.num_train == 30 and len(task.eval_prompts()) == 10
    with pytest.raises(DatasetLoadError, match="validation"):
        build_task(dataset_cfg(folder, reward_file, eval_split="validation"))


def test_conversational_jsonl_gets_message_completions(tmp_path, reward_file):
    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}+1?"}],
            "ground_truth": a + 1,
        }
        for a in range(20)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task(dataset_cfg(path, reward_file, fn="chat_exact"))
    p = task.eval_prompts()[0]
    assert p.is_chat and p.messages[0]["role"] == "system" and p.text.endswith("+1?")
    assert task.rewards([p, p], [str(p.columns["ground_truth"]), "x"], [[1], [2]], RewardStats()) == [1.0, 0.0]
    tok = build_bpe_tokenizer()
    ids = encode_prompts(tok, [p], chat_template=False)[0]  # message lists always use the template
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.")


def test_verl_parquet_loads_unchanged(tmp_path, reward_file):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {a} times 2?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
            "extra_info": {"split": "train", "index": a},
        }
        for a in range(24)
    ]
    path = tmp_path / "verl.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = DatasetTaskConfig(
        path=str(path), reward_funcs=[f"{reward_file}:compute_score"], reward_style="verl", eval_size=4
    )
    task = build_task(cfg)
    p = task.eval_prompts()[0]
    assert p.columns["ground_truth"] == p.columns["reward_model"]["ground_truth"]  # nested field flattened
    assert p.columns["extra_info"]["split"] == "train" and p.columns["data_source"] == "openai/gsm8k"
    truth = p.columns["ground_truth"]
    assert task.rewards([p, p], [truth, truth + "1"], [[1], [2]], RewardStats()) == [1.0, 0.0]
    task.check()


def test_long_prompts_are_dropped_and_counted(tmp_path, reward_file):
    rows = ROWS + [{"prompt": f"word{i} " * 400, "target": 0, "topic": "long"} for i in range(6)]
    tok = build_bpe_tokenizer()
    task = build_task(dataset_cfg(write(tmp_path, "jsonl", rows), reward_file, max_prompt_tokens=64), tokenizer=tok)
    kept = [p for p in task.sample_prompts(300, random.Random(0))] + task.eval_prompts()
    assert all(p.columns["topic"] == "sums" for p in kept)
    assert task.dropped_long + task.dropped_long_eval == 6
    assert "dropped" in task.describe() and "max_prompt_tokens=64" in task.describe()
    # every kept prompt really fits
    assert max(len(ids) for ids in encode_prompts(tok, kept)) <= 64


def test_reward_problems_are_caught_before_training(tmp_path, reward_file):
    path = write(tmp_path, "jsonl")
    with pytest.raises(RewardFunctionError, match="nothere"):
        build_task(dataset_cfg(path, reward_file, fn="nothere"))
    bad = tmp_path / "bad.py"
    bad.write_text("def needs_answer(completions, answer, **kw):\n    return [0.0] * len(completions)\n")
    task = build_task(DatasetTaskConfig(path=str(path), reward_funcs=[f"{bad}:needs_answer"], eval_size=4))
    with pytest.raises(RewardFunctionError, match="answer"):
        task.check()


def test_missing_file_and_column_say_what_to_do(tmp_path, reward_file):
    with pytest.raises(DatasetLoadError, match="does not exist"):
        build_task(dataset_cfg(tmp_path / "nope.jsonl", reward_file))
    with pytest.raises(DatasetLoadError, match="no column 'question'"):
        build_task(dataset_cfg(write(tmp_path, "jsonl"), reward_file, prompt_column="question"))
    with pytest.raises(DatasetLoadError, match="eval_size"):
        build_task(DatasetTaskConfig(path=str(write(tmp_path, "csv")), reward_funcs=[f"{reward_file}:exact"]))


def test_gsm8k_from_a_local_folder_in_the_hub_schema(tmp_path):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    others = [
        {"question": f"What is {a} doubled?", "answer": f"{a}*2=<<{a}*2={2 * a}>>{2 * a}\n#### {2 * a}"}
        for a in range(7)
    ]
    pd.DataFrame(GSM8K_ROWS * 3 + others).to_json(folder / "train.jsonl", orient="records", lines=True)
    pd.DataFrame(GSM8K_ROWS).to_json(folder / "test.jsonl", orient="records", lines=True)
    task = build_task(GSM8KTaskConfig(path=str(folder)))
    ev = task.eval_prompts()
    assert [p.answer for p in ev] == ["72", "2,500"]
    assert ev[0].text.startswith("[MATH TASK] Problem:\nNatalia") and ev[0].text.endswith("\n\nSolution:\n")
    # training copies of the test questions are never trained on
    assert task.num_train == 7 and task.overlap == 6
    assert {p.answer for p in task.sample_prompts(7, random.Random(0))} == {str(2 * a) for a in range(7)}


def test_gsm8k_rewards_with_the_paper_grader(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = GSM8K_ROWS + [
        {"question": f"What is {a}+{a}?", "answer": f"{a}+{a}=<<{a}+{a}={2 * a}>>{2 * a}\n#### {2 * a}"}
        for a in range(20)
    ]
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    task = build_task(GSM8KTaskConfig(path=str(path), eval_split=None, eval_size=2, seed=0))
    p = next(q for q in task.eval_prompts() + task.sample_prompts(30, random.Random(0)) if q.answer == "2,500")
    stats = RewardStats()
    completions = ["So the shop sells 2,500 pens.", "It sells 2500.0 pens", "About 2,400 pens", "No idea"]
    assert task.rewards([p] * 4, completions, [[1]] * 4, stats) == [1.0, 1.0, 0.0, 0.0]
    assert task.answer_key("2,500") == task.answer_key("2500.0")
    assert stats.metrics()["reward/correct_mean"] == 0.5


def test_chat_end_of_turn_token_ends_completions():
    tok = build_bpe_tokenizer()
    ids = eos_ids(tok)
    assert ids == {tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)}
    assert eos_ids(tok, chat_template=False) == {tok.eos_token_id}
    with pytest.raises(ValueError, match="not a token"):
        eos_ids(tok, extra_tokens=["<|nope|>"])
