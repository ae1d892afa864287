"""reasoning-gym's procedural datasets as a task (``task.name: reasoning_gym``), against the real
package: its problems, its ``score_answer``, a mix reported per dataset, the held-out split from
another seed, bad settings named in one line, and a run that trains on a mix. Whether training
raises the held-out reward is a study (``configs/reasoning_gym_demo.yaml``, 150 steps on 3 seeds:
benchmarks/results/reasoning_gym/README.md, by ``benchmarks/bench_headline.py``)."""

from __future__ import annotations

import random
import sys

import pytest
import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.utils import SYSTEM_PROMPTS
from tests.helpers.tiny_bpe import CHATML, build_bpe_chat_model, build_bpe_tokenizer

from tba.config import ConfigError, load_config
from tba.generation.base import Completion
from tba.metrics import read_metrics
from tba.rewards import RewardStats
from tba.tasks import build_task

MIX = "--task.datasets=[{name: chain_sum, weight: 2, config: {max_terms: 2, max_digits: 1}}, {name: letter_counting}]"


def task_of(*overrides: str, tokenizer=None):
    cfg = load_config(None, ["--task.name=reasoning_gym", *overrides])
    return build_task(cfg.task, tokenizer=tokenizer, log=lambda _: None), cfg


def test_prompts_are_the_packages_problems_and_the_held_out_ones_come_from_another_seed():
    task, cfg = task_of(MIX, "--task.size=300", "--task.eval_size=40", "--task.system_prompt=direct")
    specs = [DatasetSpec(d.name, d.weight, dict(d.config)) for d in cfg.task.datasets]
    held = reasoning_gym.create_dataset("composite", size=40, seed=cfg.task.seed + 1_000_000, datasets=specs)
    evals = task.eval_prompts()
    assert [p.text for p in evals] == [e["question"] for e in held]  # the last user turn
    assert [p.answer for p in evals] == [e["answer"] for e in held]
    assert all(p.messages[0] == {"role": "system", "content": SYSTEM_PROMPTS["direct"]} for p in evals)
    train = task.sample_prompts(600, random.Random(0))  # two epochs
    assert not {p.id for p in train} & {p.id for p in evals}
    # weights 2 : 1 (about 200 of the 300 problems are chain_sum's)
    share = sum(p.columns["dataset"] == "chain_sum" for p in train) / len(train)
    assert 0.55 < share < 0.78, share


def test_each_dataset_of_a_mix_scores_its_own_problems_with_the_packages_score_answer():
    task, _ = task_of(MIX, "--task.size=60", "--task.eval_size=10")
    prompts = task.sample_prompts(12, random.Random(1))
    assert {p.columns["dataset"] for p in prompts} == {"chain_sum", "letter_counting"}
    right = [f"I think <answer>{p.answer}</answer>" for p in prompts]
    wrong = [f"<answer>{p.answer}</answer> or rather <answer>{int(p.answer) + 1}</answer>" for p in prompts]
    untagged = [p.answer for p in prompts]
    stats = RewardStats()
    assert task.rewards(prompts, right, [[]] * 12, stats) == [1.0] * 12
    assert set(stats.last_means) == {"chain_sum", "letter_counting"}
    assert task.rewards(prompts, wrong, [[]] * 12, stats) == [0.0] * 12  # the last tags are the answer
    assert task.rewards(prompts, untagged, [[]] * 12, stats) == [0.0] * 12
    text, _ = task_of(MIX, "--task.size=60", "--task.eval_size=10", "--task.answer_format=text")
    assert text.rewards(prompts, untagged, [[]] * 12, stats) == [1.0] * 12
    sentences = [f"{int(p.answer) + 1} is wrong; the answer is {p.answer}." for p in prompts]
    number, _ = task_of(MIX, "--task.size=60", "--task.eval_size=10", "--task.answer_format=last_number")
    assert number.rewards(prompts, sentences, [[]] * 12, stats) == [1.0] * 12
    assert number.answer("about 1,234.") == "1234" and number.answer("none") is None
    # reasoning-gym's own partial credit: the reference inside a longer answer
    p = prompts[0]
    long = f"{p.answer} apples"
    expected = reasoning_gym.create_dataset(p.columns["dataset"]).score_answer(long, p.columns["entry"])
    assert text.rewards([p], [long], [[]], stats) == [expected]
    assert 0 < text.rewards([p], [long], [[]], stats)[0] < 1
    assert task.answer_key(right[0]) == prompts[0].answer and task.is_success(1.0) and not task.is_success(0.9)


def test_the_template_reads_the_problems_metadata():
    cfg = load_config("configs/reasoning_gym_demo.yaml", ["--task.size=20", "--task.eval_size=5"])
    task = build_task(cfg.task, log=lambda _: None)
    p = task.eval_prompts()[0]
    assert p.text == p.columns["entry"]["metadata"]["expression"] + "=" and p.messages is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--task.datasets=[chian_sum]"], "reasoning-gym has no dataset 'chian_sum' (did you mean chain_sum"),
        (["--task.datasets=[{name: chain_sum, config: {digits: 2}}]"], "its settings are: min_terms, max_terms"),
        (["--task.datasets=[{name: chain_sum, config: {min_terms: 0}}]"], "min_terms must be positive"),
        (["--task.datasets=chain_sum", "--task.template={expr}="], "task.template '{expr}=' cannot be filled"),
        (["--task.datasets=chain_sum", "--task.eval_seed=1300"], "would repeat training ones"),
        (["--task.datasets=[chain_sum, chain_sum]"], "listed twice"),
    ],
    ids=["unknown", "key", "value", "template", "seeds", "twice"],
)
def test_bad_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        task_of(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value).strip()


def test_without_the_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed: its import fails
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package .*pip install 'tba\[reasoning-gym\]'"):
        task_of("--task.datasets=chain_sum")


class Answering:
    """A generator that writes the reference answer, in tags, to the problems of one dataset and
    ``x`` to the others' (what the evaluation's grouping is checked against)."""

    version = 0

    def __init__(self, tokenizer, prompts, right: str):
        self.tokenizer, self.right = tokenizer, right
        self.by_question = {p.text: p for p in prompts}

    def generate(self, prompts, params):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            (p,) = [p for q, p in self.by_question.items() if q in text]
            reply = f"<answer>{p.answer}</answer>" if p.columns["dataset"] == self.right else "x"
            out.append([Completion(self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id], True)])
        return out


def test_evaluation_reports_each_dataset_of_a_mix_beside_the_whole():
    from tba.evaluation import evaluate
    from tba.types import EvalSettings

    task, _ = task_of(MIX, "--task.size=60", "--task.eval_size=20", "--task.system_prompt=direct")
    tokenizer = build_bpe_tokenizer()
    tokenizer.chat_template = CHATML
    prompts = task.eval_prompts()
    share = sum(p.columns["dataset"] == "chain_sum" for p in prompts) / len(prompts)
    assert 0 < share < 1
    result = evaluate(task, Answering(tokenizer, prompts, "chain_sum"), tokenizer, EvalSettings(max_new_tokens=8))
    assert result.metrics["eval/reward/chain_sum"] == 1.0 and result.metrics["eval/reward/letter_counting"] == 0.0
    assert result.metrics["eval/reward"] == pytest.approx(share)
    single, _ = task_of("--task.datasets=chain_sum", "--task.size=20", "--task.eval_size=5")
    alone = evaluate(
        single, Answering(tokenizer, single.eval_prompts(), "chain_sum"), tokenizer, EvalSettings(max_new_tokens=8)
    )
    assert alone.metrics["eval/reward"] == 1.0 and not any(k.startswith("eval/reward/") for k in alone.metrics)


@pytest.mark.slow
def test_a_mix_trains_with_rewards_per_dataset(tmp_path):
    """A chat model with a system prompt from reasoning-gym: each dataset's training reward and
    held-out reward are logged (in the sync runtime: a ray run's searchers send the per-function
    means the same way, tests/test_task_training.py)."""
    from tba.runtime.sync_loop import run_sync

    model = build_bpe_chat_model(tmp_path / "chat")
    cfg = load_config(
        None,
        [
            "--task.name=reasoning_gym",
            MIX,
            "--task.system_prompt=direct",
            "--task.size=100",
            "--task.eval_size=12",
            f"--model.policy={model}",
            "--runtime.type=sync",
            "--run.threads=1",
            "--generation.max_new_tokens=8",
            "--generation.prompts_per_batch=4",
            "--trainer.batch_prompts=4",
            "--trainer.steps=3",
            "--eval.every=3",
            "--logging.progress=false",
            f"--run.output_dir={tmp_path}",
            "--run.name=mix",
        ],
    )
    run_dir, summary = run_sync(cfg)
    assert summary["trainer_steps"] == 3
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert any("reward/chain_sum_mean" in r for r in rows) and any("reward/letter_counting_mean" in r for r in rows)
    (last,) = [r for r in rows if r["step"] == 3 and "eval/reward" in r]
    assert {"eval/reward/chain_sum", "eval/reward/letter_counting"} <= set(last)
