"""Reward-model rewards and the TL;DR task: scores against a direct forward pass, win rate and
KL against hand computations, and training in both runtimes with a tiny reward model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, model_terms
from tests.helpers.tiny_bpe import build_bpe_chat_model, build_reward_model
from transformers import AutoConfig, AutoModelForSequenceClassification

from tba.config import load_config
from tba.eval_metrics import win_rate
from tba.metrics import read_metrics
from tba.models.divergence import kl_and_ref_nll
from tba.rewards import RewardStats
from tba.runtime.sync_loop import run_sync
from tba.tasks import build_task
from tba.tasks.reward_model import SequenceScorer

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm"))


POSTS = [
    f"SUBREDDIT: r/tifu\n\nTITLE: I lost {a} clips\n\nPOST: Natalia sold {a} clips to her friends in April.\n\nTL;DR:"
    for a in range(30)
]


@pytest.fixture(scope="module")
def tldr_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tldr")
    for split, rows in (("train", POSTS[:24]), ("validation", POSTS[24:])):
        with (root / f"{split}.jsonl").open("w") as f:
            for q in rows:
                f.write(json.dumps({"query": q, "reference_response": " she sold clips"}) + "\n")
    return root


def test_reward_model_scores_equal_a_direct_forward_pass(reward_model):
    scorer = SequenceScorer(str(reward_model), batch_size=2, max_length=12)
    texts = ["The answer is 72.", "Natalia sold clips", "How many clips did Natalia sell altogether in April?"]
    got = scorer.score(texts)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tok = scorer.tokenizer
    terms = model_terms(model.config, 2 * 12)  # padded batches of 2 texts of at most 12 tokens
    for text, score in zip(texts, got, strict=True):
        ids = tok(text)["input_ids"][-12:]  # truncation keeps the end
        with torch.no_grad():
            direct = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert_reordered_close(score, direct, terms=terms)
    assert len(tok(texts[2])["input_ids"]) > 12  # the last text really was truncated


def test_a_classifier_is_not_a_reward_model(tmp_path):
    with pytest.raises(ValueError, match="has 2 labels"):
        SequenceScorer(str(build_reward_model(tmp_path, num_labels=2)))


def test_win_rate_counts_ties_as_losses():
    assert win_rate([1.0, 2.0, 3.0], [0.0, 2.0, 4.0]) == pytest.approx(1 / 3)
    assert win_rate([5.0], [-1.0]) == 1.0
    with pytest.raises(ValueError, match="equal"):
        win_rate([1.0], [1.0, 2.0])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_kl_and_reference_nll_against_an_explicit_per_position_sum(tmp_path, packed):
    from tba.models.packing import row_tokens, worth_packing
    from tba.models.packing_choice import can_pack

    policy_path = build_bpe_chat_model(tmp_path / "p", seed=0)
    ref_path = build_bpe_chat_model(tmp_path / "r", seed=1)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_path).eval()
    prompts, completions = [[5, 6, 7], [8, 9], [4]], [[10, 11, 12, 0], [13, 14], [15]]  # 0 is EOS: counted
    if packed:  # lengths 7, 4 and 2: two rows of 7 instead of three, so the pass is packed
        assert worth_packing([3, 2, 1], [4, 2, 1], row_tokens(policy))
    assert can_pack(policy) and can_pack(ref)
    kl, nll, n = kl_and_ref_nll(policy, ref, prompts, completions, pad_id=0, eos_ids={0}, micro_batch=3, packed=packed)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor([p + c])
        with torch.no_grad():
            lp = torch.log_softmax(policy(seq).logits[0].float(), -1)
            lr = torch.log_softmax(ref(seq).logits[0].float(), -1)
        per_pos, total_nll = [], 0.0
        for t in range(len(c)):
            pos = len(p) - 1 + t  # the logits that predict completion token t
            per_pos.append(sum(lp[pos, v].exp() * (lp[pos, v] - lr[pos, v]) for v in range(lp.shape[-1])).item())
            total_nll -= lr[pos, c[t]].item()
        # one sequence at a time against a padded or packed batch; the KL adds the vocabulary's terms per position
        terms = model_terms(policy.config, len(p) + len(c)) + len(c) * policy.config.vocab_size
        assert_reordered_close(kl[i].item(), sum(per_pos) / len(c), terms=terms, scale=total_nll / len(c))
        assert_reordered_close(nll[i].item(), total_nll, terms=terms)
        assert n[i].item() == len(c)


def test_dataset_task_with_a_reward_model(tmp_path, reward_model, tldr_data):
    cfg = load_config(
        None,
        [
            "--task.name=dataset",
            f"--task.path={tldr_data}",
            "--task.prompt_column=query",
            "--task.eval_split=validation",
            f"--task.reward_model={reward_model}",
            "--task.reward_model_weight=2.0",
        ],
    ).task
    task = build_task(cfg)
    task.check()  # no functions to dry-run; nothing loads yet
    p = task.eval_prompts()[0]
    with pytest.raises(RuntimeError, match="not loaded"):
        task.rewards([p], [" x"], [[1]], RewardStats())
    task.setup("cpu")
    got = task.rewards([p, p], [" she sold 24", " nothing"], [[1], [2]], RewardStats())
    scorer = SequenceScorer(str(reward_model))
    direct = scorer.score([p.text + " she sold 24", p.text + " nothing"])
    terms = model_terms(scorer.model.config, 2 * 1024)  # the task's batch against this one
    assert_reordered_close(got, [2.0 * d for d in direct], terms=terms)


# In the sync runtime: a task's models load in the ray runtime's searchers as they do here, and
# the ray runtime trains a task of the user's in tests/test_task_training.py.
def test_tldr_trains_and_evaluates_win_rate_and_kl(tmp_path, reward_model, tldr_data):
    policy = build_bpe_chat_model(tmp_path / "policy")
    args = [
        "--runtime.type=sync",
        f"--model.policy={policy}",
        "--model.chat_template=false",
        "--task.name=tldr",
        f"--task.path={tldr_data}",
        f"--task.reward_model={reward_model}",
        "--generation.unfinished_reward=-1",
        "--generation.group_size=4",
        "--generation.prompts_per_batch=4",
        "--generation.max_new_tokens=8",
        "--trainer.batch_prompts=4",
        "--trainer.steps=4",
        "--eval.every=2",
        "--eval.log_samples=2",
        "--logging.progress=false",
        "--runtime.trainer_cpus=1",
        f"--run.output_dir={tmp_path}",
        "--run.name=t",
    ]
    run_dir, summary = run_sync(load_config(None, args))
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("eval/win_rate") is not None]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert 0.0 <= r["eval/win_rate"] <= 1.0 and r["eval/problems"] == 6
        assert r["eval/kl"] >= 0.0 and math.isfinite(r["eval/ref_perplexity"])
    # before training the policy is the reference: the KL is zero up to the rounding of its terms
    # (log-probs of the size of the reference's per-token NLL; 6 problems of at most 64 positions;
    # the KL sums the vocabulary at each)
    config = AutoConfig.from_pretrained(policy)
    terms = model_terms(config, 6 * 64) + config.vocab_size
    scale = math.log(evals[0]["eval/ref_perplexity"])
    assert_reordered_close(evals[0]["eval/kl"], 0.0, terms=terms, scale=scale)
    assert summary["eval/win_rate_final"] == evals[-1]["eval/win_rate"]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all("answer_score" in s and s["prompt"].startswith("SUBREDDIT") for s in samples)
