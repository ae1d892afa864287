"""Task, searcher and trainer working together: searcher → buffer → trainer → published weights."""

from __future__ import annotations

import random

import pytest
import torch
from tests.conftest import assert_reports_declared
from tests.helpers.numerics import assert_reordered_close, model_terms, padded_positions
from tests.helpers.trainers import make_trainer, synthetic_groups

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.models.packing import Passes
from tba.searcher import Searcher
from tba.tasks import build_task
from tba.tasks.arithmetic import ArithmeticTask
from tba.trainer import Trainer
from tba.types import RolloutGroup
from tba.weights import LocalWeightStore

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

# ---------------------------------------------------------------- task


def test_arithmetic_answers_and_reward():
    task = ArithmeticTask(digits=2, operators="+-*", eval_size=50, seed=3)
    for p in task.sample_prompts(200, random.Random(0)):
        expr = p.text[:-1]
        assert p.text.endswith("=") and p.id == p.text
        assert int(p.answer) == eval(expr)  # noqa: S307  (digits and + - * only)
    p = task.sample_prompts(1, random.Random(1))[0]
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, f" {p.answer}\n") == 1.0
    assert task.reward(p, p.answer + "0") == 0.0
    assert task.reward(p, "") == 0.0


def test_arithmetic_eval_split_is_held_out_and_stable():
    task = ArithmeticTask(digits=1, operators="+", eval_size=30, seed=7)
    held_out = {p.text for p in task.eval_prompts()}
    assert len(held_out) == 30
    assert held_out == {p.text for p in ArithmeticTask(digits=1, operators="+", eval_size=30, seed=7).eval_prompts()}
    train = {p.text for p in task.sample_prompts(2000, random.Random(0))}
    assert not train & held_out
    assert len(train) == 100 - 30  # every other one-digit sum is reachable
    assert held_out != {p.text for p in ArithmeticTask(digits=1, operators="+", eval_size=30, seed=8).eval_prompts()}


def test_arithmetic_rejects_bad_settings():
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators="/")
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(digits=1, operators="+", eval_size=80)


def test_build_task_from_config():
    from tba.config import ArithmeticTaskConfig

    task = build_task(ArithmeticTaskConfig(digits=1, operators="-", eval_size=10))
    assert all("-" in p.text for p in task.eval_prompts())


# ---------------------------------------------------------------- searcher and trainer


class FlakyArithmetic(ArithmeticTask):
    """Raises on completions that start with an odd digit, returns NaN on those starting with 8."""

    def reward(self, prompt, completion):
        if completion[:1] in "13579" and completion:
            raise RuntimeError("grader crashed")
        if completion.startswith("8"):
            return float("nan")
        return super().reward(prompt, completion)


def make_searcher(tiny_model, tokenizer, task, weights, n=4, prompts=6):
    eos = {tokenizer.eos_token_id}
    sampler = type(tiny_model)(tiny_model.config).eval()
    return Searcher(
        task,
        tokenizer,
        HFGenerator(sampler, tokenizer.pad_token_id, eos),
        tiny_model,  # the reference
        weights,
        SamplingParams(n=n, temperature=1.0, max_new_tokens=6),
        prompts,
        eos,
        seed=0,
    )


def test_searcher_produces_tagged_scored_groups(tiny_model, tokenizer):
    torch.manual_seed(0)
    task = ArithmeticTask(digits=1, operators="+-", eval_size=10)
    weights = LocalWeightStore()
    searcher = make_searcher(tiny_model, tokenizer, task, weights)
    with pytest.raises(RuntimeError, match="publish"):
        searcher.step()
    weights.publish(tiny_model.state_dict(), 0)
    groups = searcher.step()
    assert groups and all(isinstance(g, RolloutGroup) for g in groups)
    eos = tokenizer.eos_token_id
    for g in groups:
        assert g.policy_version == 0 and 2 <= g.size <= 4
        for tokens, reward in zip(g.completions, g.rewards, strict=True):
            text = tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=True)
            a_op_b = g.prompt_id[:-1]
            assert reward == (1.0 if text.strip() == str(eval(a_op_b)) else 0.0)  # noqa: S307
        expected = Passes().sequence_logprobs(
            tiny_model, [g.prompt_ids] * g.size, g.completions, tokenizer.pad_token_id, eos
        )
        terms = model_terms(tiny_model.config, padded_positions([g.prompt_ids] * g.size, g.completions))
        assert_reordered_close(torch.tensor(g.ref_logps), expected.detach(), terms=terms)
    # new weights are picked up between batches, and the data says so
    weights.publish(tiny_model.state_dict(), 3)
    assert all(g.policy_version == 3 for g in searcher.step())
    assert searcher.metrics()["searcher/version"] == 3


def test_searcher_counts_and_skips_bad_rewards(tiny_model, tokenizer):
    torch.manual_seed(1)
    task = FlakyArithmetic(digits=1, operators="+", eval_size=10)
    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    searcher = make_searcher(tiny_model, tokenizer, task, weights, n=8, prompts=8)
    groups = [g for _ in range(3) for g in searcher.step()]  # no exception escapes
    m = searcher.metrics()
    assert_reports_declared(m)
    assert m["searcher/reward_errors"] > 0 and m["searcher/reward_non_finite"] > 0
    eos = tokenizer.eos_token_id
    for g in groups:
        for tokens in g.completions:
            text = tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=True)
            assert not (text[:1] in "13579" and text) and not text.startswith("8")
    kept = sum(g.size for g in groups)
    # reward_errors counts every failed sample (non_finite is the NaN/inf part of it)
    assert m["searcher/reward_errors"] > m["searcher/reward_non_finite"]
    dropped = m["searcher/reward_errors"] + m["searcher/empty_completions"]
    lost_in_small_groups = m["searcher/completions"] - kept - dropped
    assert 0 <= lost_in_small_groups <= m["searcher/dropped_groups"]  # a dropped group held at most one


def test_trainer_skip_advances_version_schedule_and_publications_without_an_update(tiny_model, tokenizer):
    weights = LocalWeightStore()
    trainer = make_trainer(tiny_model, tokenizer, ReplayBuffer(capacity=100, seed=0), weights, warmup_steps=4)
    trainer.publish()
    before = [p.detach().clone() for p in tiny_model.parameters()]
    first = trainer.skip()
    assert trainer.version == 1 and weights.visible_version == 0  # sync_interval 2: no publication yet
    assert first["train/empty_steps"] == first["train/skipped_steps"] == 1.0
    assert first["train/lr"] == pytest.approx(1e-3 * 2 / 5)  # warm-up's second value: the schedule moved on
    second = trainer.skip()
    assert trainer.version == 2 and weights.visible_version == 2 and "train/publish_s" in second
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters(), strict=True))
    assert trainer.optimizer.state == {}  # AdamW took no step: its moments were not touched
    state = trainer.state_dict()
    again = make_trainer(tiny_model, tokenizer, ReplayBuffer(capacity=100, seed=0), LocalWeightStore(), warmup_steps=4)
    again.load_state_dict(state)
    assert (again.version, again.empty_steps, again.skipped_steps) == (2, 2, 2)
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.optimizer.param_groups[0]["lr"])


def test_trainer_steps_publish_and_track_versions(tiny_model, tokenizer):
    buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
    weights = LocalWeightStore()
    trainer = make_trainer(tiny_model, tokenizer, buffer, weights)
    trainer.publish()
    assert weights.visible_version == 0
    assert trainer.ingest(synthetic_groups(tokenizer)) == 24
    before = [p.detach().clone() for p in tiny_model.parameters()]
    m = trainer.step()
    assert trainer.version == 1 and weights.visible_version == 0  # sync_interval=2: not yet
    for key in ("train/loss", "train/reward_mean", "train/log_z", "train/kl", "buffer/size", "train/grad_norm"):
        assert key in m and m[key] == m[key]
    assert m["buffer/size"] == 24 and m["train/lag_mean"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters(), strict=True))
    m = trainer.step()
    assert weights.visible_version == 2 and "train/publish_s" in m
    assert m["train/lag_mean"] == 1 and m["train/lag_max"] == 1  # data from version 0 trained at step 2
    # the published copy does not move with later optimizer steps
    published = weights.fetch(newer_than=-1)[1]
    snapshot = {k: v.clone() for k, v in published.items()}
    trainer.step()
    assert all(torch.equal(snapshot[k], published[k]) for k in snapshot)


def test_micro_batches_give_the_full_batch_gradient(tokenizer):
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    grads = []
    for micro in (None, 1, 2):
        model = build_tiny_llama(tokenizer, SMALL).double()
        buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
        trainer = make_trainer(model, tokenizer, buffer, LocalWeightStore(), micro_batch_prompts=micro)
        trainer.ingest(synthetic_groups(tokenizer))
        batch = buffer.sample(4, 4)
        metrics = trainer._accumulate_gradients(batch, beta=0.5)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), metrics["train/loss"]))
    # float64 weights; micro-batches add the groups' gradients in another order (16 rows of at
    # most 16 positions)
    terms = model_terms(model.config, 16 * 16)
    for g, loss in grads[1:]:
        assert_reordered_close(g, grads[0][0], dtype=torch.float64, terms=terms)
        assert_reordered_close(loss, grads[0][1], dtype=torch.float64, terms=terms)


def test_non_finite_step_is_skipped(tiny_model, tokenizer):
    buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
    trainer = make_trainer(tiny_model, tokenizer, buffer, LocalWeightStore())
    groups = synthetic_groups(tokenizer)
    for g in groups:
        g.ref_logps = [float("inf")] * g.size
    trainer.ingest(groups)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    m = trainer.step()
    assert m["train/skipped_steps"] == 1 and trainer.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters(), strict=True))


def test_searcher_buffer_trainer_round_trip_raises_reward(tokenizer):
    """On a two-prompt problem the loop must learn: reward of sampled completions goes up."""
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    class TwoPrompts(ArithmeticTask):
        def sample_prompts(self, n, rng):
            return [self._prompt((2, "+", 2)), self._prompt((3, "+", 1))] * (n // 2)

        def reward(self, prompt, completion):
            return 1.0 if completion[:1] in "01234" and completion else 0.0

    torch.manual_seed(0)
    task = TwoPrompts(digits=1, operators="+", eval_size=5)
    policy = build_tiny_llama(tokenizer, SMALL).train()
    reference = build_tiny_llama(tokenizer, SMALL).eval().requires_grad_(False)
    weights = LocalWeightStore()
    buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
    trainer = make_trainer(policy, tokenizer, buffer, weights, sync_interval=1, lr=3e-3, batch_prompts=2, beta=0.2)
    trainer.publish()
    searcher = make_searcher(reference, tokenizer, task, weights, n=4, prompts=2)
    searcher.params = SamplingParams(n=4, temperature=1.0, max_new_tokens=2)
    rewards = []
    for _ in range(40):
        groups = searcher.step()
        rewards.append(sum(r for g in groups for r in g.rewards) / max(1, sum(g.size for g in groups)))
        trainer.ingest(groups)
        if buffer.can_sample(2):
            trainer.step()
    assert searcher.version == trainer.version - 1 or searcher.version == trainer.version
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.3


@pytest.mark.parametrize("objective", ["tb", "grpo", "dr_grpo", "ppo", "rloo", "online_dpo"])
def test_every_objective_trains_from_searcher_data(tokenizer, objective):
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    torch.manual_seed(0)
    task = ArithmeticTask(digits=1, operators="+", eval_size=5)
    policy = build_tiny_llama(tokenizer, SMALL).train()
    reference = build_tiny_llama(tokenizer, SMALL).eval().requires_grad_(False)
    weights = LocalWeightStore()
    buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
    cfg = TrainerConfig(batch_prompts=2, lr=1e-3, warmup_steps=0, sync_interval=1)
    obj = ObjectiveConfig(type=objective, beta=0.1, rloo_proximal=objective == "rloo")
    eos = {tokenizer.eos_token_id}
    trainer = Trainer(policy, buffer, weights, cfg, obj, 4, tokenizer.pad_token_id, eos, max_new_tokens=4)
    trainer.publish()
    searcher = make_searcher(reference, tokenizer, task, weights, n=4, prompts=4)
    searcher.params = SamplingParams(n=4, temperature=1.0, max_new_tokens=4, logprobs=trainer.sampler_logps)
    for step in range(4):
        groups = searcher.step()
        if trainer.sampler_logps:
            assert all(g.sampler_token_logps is not None for g in groups)
            assert all(
                len(t) == len(c) for g in groups for t, c in zip(g.sampler_token_logps, g.completions, strict=True)
            )
        trainer.ingest(groups)
        m = trainer.step()
        assert all(v == v and abs(v) != float("inf") for v in m.values()), m  # no NaN or inf
        if step == 0 and "train/ratio_mean" in m:  # the first batch is exactly on-policy
            # up to generation's cached forward against the trainer's: e^δ, δ within the tolerance of
            # the largest sequence log-prob (ratios of tokens or of whole sequences)
            with torch.no_grad():
                scale = max(
                    Passes()
                    .sequence_logprobs(policy, [g.prompt_ids] * g.size, g.completions, tokenizer.pad_token_id, eos)
                    .abs()
                    .max()
                    .item()
                    for g in groups
                )
            terms = model_terms(policy.config, 4 * 4 * (max(len(g.prompt_ids) for g in groups) + 4))
            assert_reordered_close(m["train/ratio_mean"], 1.0, terms=terms, scale=scale)
    assert m["train/skipped_steps"] == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, max_new_tokens=5, logprobs=True),
        # from the sampling pass: log π at temperature 1 from the model's own logits, whatever the
        # sampler's temperature, top-p and EOS mask (min_new_tokens) did to pick the token
        SamplingParams(n=3, max_new_tokens=5, logprobs=True, sampled_logprobs=True),
        SamplingParams(
            n=3, temperature=0.7, top_p=0.9, max_new_tokens=6, min_new_tokens=2, logprobs=True, sampled_logprobs=True
        ),
    ],
    ids=["teacher_forced", "sampled", "sampled_warped"],
)
def test_generator_token_logps_match_teacher_forcing(tiny_model, tokenizer, params, monkeypatch):
    from tba.generation import hf
    from tba.models.logprobs import token_logprobs

    if params.sampled_logprobs:  # no second pass
        monkeypatch.setattr(hf, "token_logprobs", lambda *a, **k: pytest.fail("teacher-forced pass"))
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("33+4=")["input_ids"]]
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos})
    hooks = len(tiny_model._forward_hooks)
    outs = gen.generate(prompts, params)
    assert len(tiny_model._forward_hooks) == hooks  # the sampled path's hook is gone
    for prompt, group in zip(prompts, outs, strict=True):
        for c in group:
            assert len(c.token_logps) == len(c.token_ids) >= params.min_new_tokens
            expected, _ = token_logprobs(tiny_model, [prompt], [c.token_ids], tokenizer.pad_token_id, eos)
            # generation's cached, one-position-at-a-time forward against the whole sequence's
            terms = model_terms(tiny_model.config, len(prompt) + len(c.token_ids))
            assert_reordered_close(torch.tensor(c.token_logps), expected[0, : len(c.token_ids)], terms=terms)


def test_reference_follows_the_policy_every_rho_steps(tokenizer):
    """TBA′: with ref_reset_every=ρ the searcher's reference becomes the published policy each
    time the published version crosses a multiple of ρ."""
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    task = ArithmeticTask(digits=1, operators="+", eval_size=5)
    reference = build_tiny_llama(tokenizer, SMALL).eval()
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    weights = LocalWeightStore()
    searcher = make_searcher(reference, tokenizer, task, weights)
    searcher.ref_reset_every = 4

    def publish(version, value):
        weights.publish({k: torch.full_like(v, value) for k, v in original.items()}, version)
        searcher.pull_weights()

    publish(0, 0.5)
    publish(3, 0.25)
    assert all(torch.equal(reference.state_dict()[k], original[k]) for k in original)
    publish(4, 0.125)
    assert all((v == 0.125).all() for v in reference.state_dict().values())
    publish(6, 0.0625)
    assert all((v == 0.125).all() for v in reference.state_dict().values())
    publish(9, 0.03125)  # crossed 8
    assert all((v == 0.03125).all() for v in reference.state_dict().values())


def small_components(checkpoint, *overrides: str):
    """The parts of a sync run of one-digit problems on ``checkpoint``: K=4, 4 prompts a batch."""
    from tests.conftest import components

    from tba.config import load_config

    base = ["--task.digits=1", "--task.eval_size=10", "--generation.group_size=4", "--generation.prompts_per_batch=4"]
    cfg = load_config(None, [f"--model.policy={checkpoint}", *base, "--trainer.batch_prompts=2", *overrides])
    return cfg, components(cfg, log=lambda m: None)


def test_searchers_generate_s_per_prompt_and_the_trainer_takes_k(tiny_checkpoint):
    cfg, c = small_components(tiny_checkpoint, "--generation.samples_per_prompt=6")
    c.trainer.publish()
    groups = c.searcher.step()
    assert c.searcher.stats.completions == 4 * 6 and max(g.size for g in groups) <= 6
    c.trainer.ingest(groups + c.searcher.step())
    batch = c.buffer.sample(2, cfg.generation.group_size)
    assert batch.group_size == 4 and len(batch.rollouts) == 8


def test_the_searchers_reference_pass_is_cut_as_the_trainers_passes_are(tiny_checkpoint):
    budget = 40
    _, c = small_components(
        tiny_checkpoint, "--trainer.micro_batch_prompts=1", f"--trainer.micro_batch_tokens={budget}"
    )
    s = c.searcher
    assert (s.ref_micro_batch, s.ref_max_tokens) == (4, budget)  # one group's sequences, the trainer's budget
    c.trainer.publish()
    passes = []

    def record(module, args, kwargs, out):
        passes.append(tuple(kwargs["input_ids"].shape))

    hook = s.reference.register_forward_hook(record, with_kwargs=True)
    groups = s.step()
    hook.remove()
    assert len(passes) > 1 and all(n * length <= budget or n == 1 for n, length in passes), passes
    pad = c.tokenizer.pad_token_id
    for g in groups:  # the values one pass over the group gives
        prompts = [g.prompt_ids] * g.size
        whole = Passes().sequence_logprobs(s.reference, prompts, g.completions, pad, c.eos_ids)
        terms = model_terms(s.reference.config, padded_positions(prompts, g.completions))
        assert_reordered_close(torch.tensor(g.ref_logps), whole, terms=terms)
