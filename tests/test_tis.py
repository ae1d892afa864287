"""Sampler/trainer mismatch: truncated importance sampling (``objective.tis_cap``) against hand
values, the mismatch metrics, and the trainer's step with and without the correction."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close
from tests.helpers.trainers import batch_and_trainer, reorder_terms

from tba.config import ConfigError, ObjectiveConfig, load_config
from tba.objectives import grpo_loss, rloo_loss, sampler_mismatch, sequence_is_weights, truncated_is_weights
from tba.plan.auto import needs_sampler_logps
from tba.trainer import Trainer
from tba.types import Batch

T = torch.tensor


def test_token_weights_are_the_capped_ratio_on_the_mask_only():
    old = T([[-1.0, -2.0, -3.0], [-0.2, -0.1, 0.0]])
    sampler = T([[-1.5, -1.0, -9.0], [-1.0, -0.1, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, sampler, mask, cap=2.0)
    # exp(0.5) = 1.6487, exp(−1) = 0.3679, masked 0; exp(0.8) = 2.2255 → 2, exp(0) = 1
    torch.testing.assert_close(w, T([[math.exp(0.5), math.exp(-1.0), 0.0], [2.0, 1.0, 0.0]]))
    torch.testing.assert_close(
        truncated_is_weights(old, sampler, mask, cap=1.5), T([[1.5, math.exp(-1.0), 0.0], [1.5, 1.0, 0.0]])
    )


def test_sequence_weights_cap_the_ratio_of_whole_sequences():
    w = sequence_is_weights(T([-3.0, -1.0, -2.0]), T([-2.5, -3.0, -2.0]), cap=2.0)
    torch.testing.assert_close(w, T([math.exp(-0.5), 2.0, 1.0]))


def test_mismatch_metrics_by_hand():
    old = T([[-1.0, -2.0], [-0.3, 0.0]])
    sampler = T([[-1.5, -1.0], [-0.5, -7.0]])  # differences 0.5, −1.0 | 0.2, (masked)
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    m = sampler_mismatch(old, sampler, mask, cap=1.5)
    assert m["sampler_logp_diff"] == pytest.approx((0.5 + 1.0 + 0.2) / 3)
    assert m["sampler_logp_bias"] == pytest.approx((0.5 - 1.0 + 0.2) / 3)
    # a sampler that reports a flatter distribution's log-probs (the sampled, likely tokens less
    # likely than the policy says): a positive bias; the same gap in both directions: none
    flat = sampler_mismatch(T([[-0.2, -0.3]]), T([[-0.6, -0.7]]), T([[1.0, 1.0]]))
    noise = sampler_mismatch(T([[-0.2, -0.3]]), T([[-0.6, 0.1]]), T([[1.0, 1.0]]))
    fp32 = 4 * torch.finfo(torch.float32).eps  # two fp32 differences of log-probs below 1, summed
    assert flat["sampler_logp_bias"] == pytest.approx(0.4, abs=fp32)
    assert noise["sampler_logp_bias"] == pytest.approx(0.0, abs=fp32)
    assert flat["sampler_logp_diff"] == pytest.approx(0.4, abs=fp32)
    assert noise["sampler_logp_diff"] == pytest.approx(0.4, abs=fp32)
    # sequence weights exp(−0.5), exp(0.2): (Σw)² / (2·Σw²) = 0.89835
    assert m["sampler_ess"] == pytest.approx(0.8983527, abs=1e-6)
    assert m["tis_truncated"] == pytest.approx(1 / 3)  # exp(0.5) > 1.5; exp(−1), exp(0.2) are not
    agree = sampler_mismatch(old, old, mask)
    assert agree == {"sampler_logp_diff": 0.0, "sampler_logp_bias": 0.0, "sampler_ess": pytest.approx(1.0)}


def test_grpo_terms_are_weighted_per_token_by_hand():
    # one prompt, two one-token completions, on the trainer's own log-probs (ratio 1)
    tok = T([[-1.0], [-0.5]], requires_grad=True)
    mask = T([[1.0], [1.0]])
    w = T([[2.0], [0.5]])
    loss, _ = grpo_loss(tok, tok.detach(), mask, T([1.0, 0.0]), 2, is_weight=w)
    a = 0.5 / (1 / math.sqrt(2) + 1e-6)  # advantages ±1/√2
    assert loss.item() == pytest.approx(-(2.0 * a - 0.5 * a) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(tok.grad, T([[-2.0 * a / 2], [0.5 * a / 2]]))


def test_rloo_terms_are_weighted_per_sequence_by_hand():
    logp = T([-1.0, -2.0, -3.0], requires_grad=True)
    ref = T([-1.0, -2.0, -3.0])
    w = T([2.0, 1.0, 0.25])
    loss, _ = rloo_loss(logp, ref, T([3.0, 0.0, 0.0]), beta=0.1, group_size=3, is_weight=w)
    # leave-one-out advantages (KL term 0: logp = ref): 3 − 0, 0 − 1.5, 0 − 1.5
    # −mean(w·A·log π) = −(2·3·(−1) + 1·(−1.5)·(−2) + 0.25·(−1.5)·(−3)) / 3
    assert loss.item() == pytest.approx(-(-6.0 + 3.0 + 1.125) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, T([-2.0 * 3.0 / 3, 1.5 / 3, 0.25 * 1.5 / 3]))


def test_tis_cap_is_for_ratio_objectives_and_turns_on_sampler_logps_for_rloo():
    with pytest.raises(ConfigError, match="tis_cap.*tb uses no sampler log-probs"):
        load_config(None, ["--objective.tis_cap=2"])
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(None, ["--objective.type=grpo", "--objective.tis_cap=0.5"])
    assert needs_sampler_logps(ObjectiveConfig(type="rloo", tis_cap=2.0), None)
    assert not needs_sampler_logps(ObjectiveConfig(type="rloo"), None)


def logp_scale(batch: Batch) -> float:
    """The largest token log-prob: the size of the numbers whose rounding the metrics see."""
    return max(abs(t) for r in batch.rollouts for t in r.sampler_token_logps)


def gradient(trainer: Trainer, batch: Batch) -> tuple[torch.Tensor, dict]:
    trainer.model.zero_grad(set_to_none=True)
    metrics = trainer._accumulate_gradients(batch, beta=0.1)
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return grad, metrics


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "ppo", "rloo"])
def test_the_trainer_weights_each_term_by_the_capped_sampler_ratio(tokenizer, kind):
    """Sampler log-probs log 4 below the trainer's: every token weight is min(4, 2) = 2 (and every
    sequence weight, for RLOO), so the step's gradient is exactly twice the on-policy one."""
    objective = ObjectiveConfig(type=kind, tis_cap=2.0, beta=0.1)
    trainer, on_policy = batch_and_trainer(tokenizer, objective, shift=0.0)
    g1, m1 = gradient(trainer, on_policy)
    _, shifted = batch_and_trainer(tokenizer, objective, shift=-math.log(4))
    g2, m2 = gradient(trainer, shifted)
    assert g1.abs().max() > 0
    # the trainer's forward recomputes the sampler's log-probs in its own order: ratios of 1 ± ε
    terms, scale = reorder_terms(trainer), logp_scale(on_policy)
    assert_reordered_close(g2, 2 * g1, terms=terms)
    assert_reordered_close(m1["train/sampler_logp_diff"], 0.0, terms=terms, scale=scale)
    assert m1["train/tis_truncated"] == 0
    assert_reordered_close(m2["train/sampler_logp_diff"], math.log(4), terms=terms, scale=scale)
    assert m2["train/tis_truncated"] == pytest.approx(1.0)
    # all sequences are not equally weighted: their lengths differ, so Π_t 4 differs too
    assert 0 < m2["train/sampler_ess"] < 1 and m1["train/sampler_ess"] == pytest.approx(1.0)


def test_without_the_cap_the_ratio_is_to_the_sampler_and_the_mismatch_is_still_logged(tokenizer):
    objective = ObjectiveConfig(type="grpo", beta=0.1)
    trainer, shifted = batch_and_trainer(tokenizer, objective, shift=-0.1)
    _, m = gradient(trainer, shifted)
    terms, scale = reorder_terms(trainer), logp_scale(shifted) + 0.1
    # π_θ/π_sampler, as today: e^0.1 up to the rounding of the log-probs in its exponent
    assert_reordered_close(m["train/ratio_mean"], math.exp(0.1), terms=terms, scale=math.exp(0.1) * scale)
    assert_reordered_close(m["train/sampler_logp_diff"], 0.1, terms=terms, scale=scale)
    assert "train/tis_truncated" not in m
