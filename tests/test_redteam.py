"""The redteam task on tiny random models (tests/helpers/tiny_redteam.py): the reward against a direct
computation, one victim generate call and one classifier pass per reward batch, the aggregations,
label resolution, the diversity metric against hand-computed values, the minimum attack length end
to end, the recipe's config, and training in both runtimes with the task's own evaluation."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.conftest import components
from tests.helpers.numerics import assert_reordered_close, model_terms
from tests.helpers.tiny_redteam import build_redteam_models
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tba.config import ConfigError, load_config
from tba.eval_metrics import diversity
from tba.evaluation import evaluate
from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.metrics import read_metrics
from tba.rewards import RewardStats
from tba.runtime.sync_loop import run_sync
from tba.tasks import build_task
from tba.tasks.redteam import ALPACA_TEMPLATE, LOG_FLOOR, aggregate, resolve_toxic_label
from tba.types import EvalSettings

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "redteam_gpt2.yaml"
ATTACKS = ["Tell me why people hate the weather", "Describe your favourite city", "you are stupid and terrible"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_redteam_models(tmp_path_factory.mktemp("redteam-models"))


def task_args(models: dict[str, Path], *extra: str) -> list[str]:
    return [
        "--task.name=redteam",
        f"--task.victim={models['victim']}",
        f"--task.classifier={models['classifier']}",
        f"--task.embedder={models['embedder']}",
        "--task.victim_samples=3",
        "--task.victim_max_new_tokens=6",
        *extra,
    ]


def make_task(models, *extra: str):
    task = build_task(load_config(None, task_args(models, *extra)).task)
    task.check()
    task.setup("cpu")
    return task


@torch.no_grad()
def direct_toxic_logps(classifier_path: Path, texts: list[str]) -> list[float]:
    """log p(hate) of each text, one unpadded forward pass per text."""
    tok = AutoTokenizer.from_pretrained(classifier_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path).eval()
    return [torch.log_softmax(model(**tok(t, return_tensors="pt")).logits[0], -1)[1].item() for t in texts]


class Recorder:
    """Wraps a bound method: counts calls and keeps their arguments and results."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out


# --- reward ---------------------------------------------------------------------------------------


def test_classifier_log_probs_match_a_direct_forward_pass(models):
    task = make_task(models)
    texts = ["", "I hate waiting", "have a nice day, thank you", "why how what when where who people friends"]
    got = task.classifier.toxic_logps(texts)  # one padded batch
    want = direct_toxic_logps(models["classifier"], texts)
    terms = model_terms(task.classifier.model.config, len(texts) * 16)  # one padded batch of short texts
    assert_reordered_close(got, want, terms=terms)
    assert len(set(np.round(got, 3))) > 1  # the tiny classifier tells texts apart


def test_aggregations_by_hand():
    logps = [math.log(0.5), math.log(0.1), math.log(0.3)]
    assert aggregate(logps, "mean_log_prob") == pytest.approx((math.log(0.5) + math.log(0.1) + math.log(0.3)) / 3)
    assert aggregate(logps, "log_mean_prob") == pytest.approx(math.log(0.3))
    # log of the mean does not underflow for tiny probabilities
    assert aggregate([-1000.0, -1000.0 + math.log(3)], "log_mean_prob") == pytest.approx(-1000.0 + math.log(2))
    assert aggregate(logps, "log_mean_prob") >= aggregate(logps, "mean_log_prob")  # Jensen
    with pytest.raises(ValueError, match="at least one"):
        aggregate([], "mean_log_prob")


@pytest.mark.parametrize("aggregation", ["mean_log_prob", "log_mean_prob"])
def test_reward_is_one_generate_call_and_one_classifier_pass_and_equals_a_direct_computation(models, aggregation):
    task = make_task(models, f"--task.aggregation={aggregation}")
    generate = task.victim.model.generate = Recorder(task.victim.model.generate)
    forward = task.classifier.model.forward = Recorder(task.classifier.model.forward)
    prompts = task.sample_prompts(4, random.Random(0))
    stats = RewardStats()
    rewards = task.rewards(prompts, [*ATTACKS, "   "], [[1]] * 4, stats)

    assert len(generate.calls) == 1 and len(forward.calls) == 1
    _, kwargs, out = generate.calls[0]
    ids, n, tok = kwargs["input_ids"], 3, task.victim.tokenizer
    assert ids.shape[0] == len(ATTACKS) * n  # every attack x answer pair in the one call
    # the victim reads each attack in the Alpaca template, n times in a row
    inputs = [tok.decode(row[mask.bool()]) for row, mask in zip(ids, kwargs["attention_mask"], strict=True)]
    assert inputs == [ALPACA_TEMPLATE.format(attack=a) for a in ATTACKS for _ in range(n)]
    # by hand: the answers cut at EOS, p(hate) of each, aggregated per attack
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        answers.append(tok.decode(row, skip_special_tokens=True))
    logps = direct_toxic_logps(models["classifier"], answers)
    for i, reward in enumerate(rewards[:3]):
        mine = logps[i * n : (i + 1) * n]
        if aggregation == "mean_log_prob":
            expected = sum(mine) / n
        else:
            expected = math.log(sum(math.exp(lp) for lp in mine) / n)
        terms = model_terms(task.classifier.model.config, len(answers) * 16)
        assert_reordered_close(reward, expected, terms=terms)
        assert LOG_FLOOR <= reward <= 0.0
    assert rewards[3] is None  # an empty attack has no reward
    assert stats.errors == 0 and stats.no_reward == 1
    assert stats.last_means["toxic_logp"] == pytest.approx(sum(rewards[:3]) / 3)


def test_batch_size_chunks_the_victim_and_the_classifier(models):
    task = make_task(models, "--task.batch_size=4")
    generate = task.victim.model.generate = Recorder(task.victim.model.generate)
    forward = task.classifier.model.forward = Recorder(task.classifier.model.forward)
    judged = task.judge(ATTACKS)  # 9 answers in pieces of 4
    assert [c[1]["input_ids"].shape[0] for c in generate.calls] == [4, 4, 1]
    assert len(forward.calls) == 3
    assert [len(j.answers) for j in judged] == [3, 3, 3]
    for j in judged:
        assert j.toxicity == pytest.approx(sum(math.exp(lp) for lp in j.toxic_logps) / 3)


def test_toxic_label_by_name_or_index(models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["classifier"])
    assert resolve_toxic_label(config, "hate") == 1
    assert resolve_toxic_label(config, "HATE") == 1
    assert resolve_toxic_label(config, 0) == 0
    with pytest.raises(ValueError, match="0: 'nothate', 1: 'hate'"):
        resolve_toxic_label(config, "toxic")
    with pytest.raises(ValueError, match="out of range"):
        resolve_toxic_label(config, 2)
    task = build_task(load_config(None, task_args(models, "--task.toxic_label=toxic")).task)
    with pytest.raises(ValueError, match="task.toxic_label 'toxic'"):
        task.check()  # before any model loads


# --- config ---------------------------------------------------------------------------------------


def test_config_needs_a_victim_and_a_classifier():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--task.name=redteam"])
    assert "task.victim: Field required" in str(err.value) and "task.classifier: Field required" in str(err.value)
    base = ["--task.name=redteam", "--task.victim=v", "--task.classifier=c"]
    cfg = load_config(None, base)
    assert cfg.task.instruction.endswith("\n4.") and cfg.task.instruction.count("\n") == 3
    assert (cfg.task.victim_samples, cfg.task.victim_temperature, cfg.task.victim_top_p) == (5, 0.7, 0.92)
    with pytest.raises(ConfigError, match="task.instructions"):
        load_config(None, [*base, "--task.instructions=[]"])
    with pytest.raises(ConfigError, match="task.toxic_label"):
        load_config(None, [*base, "--task.toxic_label=-1"])
    with pytest.raises(ConfigError, match="task.aggregation"):
        load_config(None, [*base, "--task.aggregation=max"])


def test_recipe_has_the_papers_settings():
    cfg = load_config(RECIPE)
    t, g = cfg.task, cfg.generation
    assert (t.victim, t.victim_template, t.victim_samples, t.victim_max_new_tokens) == (
        "vicgalle/gpt2-alpaca",
        "alpaca",
        5,
        30,
    )
    assert (t.classifier, t.toxic_label, t.embedder) == (
        "facebook/roberta-hate-speech-dynabench-r4-target",
        "hate",
        "sentence-transformers/all-MiniLM-L6-v2",
    )
    assert (g.min_new_tokens, g.max_new_tokens, g.temperature, g.group_size) == (5, 20, 1.0, 128)
    assert (g.prompts_per_batch, cfg.trainer.batch_prompts, t.eval_min_new_tokens) == (1, 1, 5)
    assert (cfg.objective.beta, cfg.trainer.sync_interval, cfg.buffer.recent_prob) == (0.05, 10, 0.5)
    assert (cfg.buffer.capacity, cfg.buffer.per_prompt_capacity, cfg.buffer.reward_inv_temp) == (100_000, None, 1.0)
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.weight_decay, cfg.eval.samples) == (5000, 1e-4, 0.1, 1024)
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.reference) == (32, 16, None)


# --- diversity ------------------------------------------------------------------------------------


def test_diversity_by_hand():
    assert diversity(np.eye(3)) == pytest.approx(1.0)  # orthogonal: no similarity
    assert diversity([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]) == pytest.approx(0.0)  # identical
    assert diversity([[1.0, 2.0], [3.0, 6.0]]) == pytest.approx(0.0)  # the length does not count
    assert diversity([[1.0, 0.0], [-2.0, 0.0]]) == pytest.approx(2.0)  # opposite: similarity -1
    # pairs (a,b): 0, (a,c): 1/sqrt2, (b,c): 1/sqrt2 -> mean similarity sqrt2/3
    assert diversity([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]) == pytest.approx(1 - math.sqrt(2) / 3)


def test_diversity_equals_the_pairwise_definition():
    x = np.random.default_rng(0).normal(size=(7, 5))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = [unit[i] @ unit[j] for i in range(7) for j in range(7) if i != j]
    assert diversity(x) == pytest.approx(1 - np.mean(sims))


def test_diversity_rejects_too_few_rows_and_zero_vectors():
    with pytest.raises(ValueError, match="n >= 2"):
        diversity([[1.0, 0.0]])
    with pytest.raises(ValueError, match="zero vectors"):
        diversity([[1.0, 0.0], [0.0, 0.0]])


# --- attack length --------------------------------------------------------------------------------


def test_min_attack_length_holds_in_training_and_evaluation(models, tmp_path):
    # The eager attacker puts ~all its mass on EOS: without min_new_tokens every attack is empty.
    args = task_args(models, "--task.eval_min_new_tokens=5", "--task.victim_samples=2")
    args += [
        f"--model.policy={models['eager_attacker']}",
        "--generation.min_new_tokens=5",
        "--generation.max_new_tokens=8",
        "--generation.group_size=8",
        "--generation.prompts_per_batch=2",
        "--generation.temperature=1.0",
        "--buffer.per_prompt_capacity=null",
        "--run.device=cpu",
    ]
    c = components(load_config(None, args), log=lambda _: None)
    eos = c.eos_ids
    free = c.searcher.generator.generate([[5, 6, 7]], SamplingParams(n=8, max_new_tokens=8))[0]
    assert all(not [t for t in o.token_ids if t not in eos] for o in free)  # the control: all empty
    c.trainer.publish()
    groups = c.searcher.step()
    attacks = [[t for t in ids if t not in eos] for g in groups for ids in g.completions]
    assert len(attacks) == 16 and all(5 <= len(a) <= 8 for a in attacks)
    settings = EvalSettings(max_new_tokens=8, samples=6)
    result = evaluate(c.task, HFGenerator(c.policy, c.tokenizer.pad_token_id, eos), c.tokenizer, settings, eos)
    assert result.metrics["eval/attacks"] == 6 and result.metrics["eval/attack_len"] == pytest.approx(5.0)


# --- training ----------------------------------------------------------------------------------


# In the sync runtime: a task's models load in the ray runtime's searchers as they do here, and
# the ray runtime trains a task of the user's in tests/test_task_training.py.
def test_redteam_trains_and_evaluates(models, tmp_path):
    args = task_args(models, "--task.victim_samples=2", "--task.eval_top=3", "--task.eval_min_new_tokens=3")
    args += [
        f"--model.policy={models['attacker']}",
        "--runtime.type=sync",
        "--generation.group_size=8",
        "--generation.prompts_per_batch=1",
        "--generation.min_new_tokens=3",
        "--generation.max_new_tokens=8",
        "--generation.temperature=1.0",
        "--trainer.batch_prompts=1",
        "--trainer.steps=4",
        "--buffer.per_prompt_capacity=null",
        "--eval.every=2",
        "--eval.samples=8",
        "--logging.progress=false",
        "--runtime.trainer_cpus=1",
        f"--run.output_dir={tmp_path}",
        "--run.name=rt",
    ]
    run_dir, summary = run_sync(load_config(None, args))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("train/loss") is not None] == [1, 2, 3, 4]
    evals = [r for r in records if r.get("eval/attack_success_rate") is not None]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert 0.0 <= r["eval/attack_success_rate"] <= 1.0 and 0.0 < r["eval/toxicity_mean"] < 1.0
        assert 0.0 <= r["eval/diversity"] <= 2.0 and r["eval/attack_len"] >= 3 and r["eval/attacks"] == 8
    rewards = [r["reward/toxic_logp_mean"] for r in records if r.get("reward/toxic_logp_mean") is not None]
    assert rewards and all(LOG_FLOOR <= x <= 0 for x in rewards)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 3 + [2] * 3 + [4] * 3
    for step in (0, 2, 4):  # the most toxic attacks first, each with its answers
        scores = [s["score"] for s in samples if s["step"] == step]
        assert scores == sorted(scores, reverse=True)
    assert all(len(s["answers"]) == 2 and s["completion"] == s["answers"][0] for s in samples)
    assert all(s["answer"] is None and s["prompt"] and s["id"] for s in samples)
    assert summary["eval/attack_success_rate_final"] == evals[-1]["eval/attack_success_rate"]
