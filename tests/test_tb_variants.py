"""Trajectory balance on stale data: the variants of ``objective.type=tb`` (a trust region on the
residual, an M2PO-style second-moment mask, a Huber residual, an ESS-scaled step) against values
computed by hand, and each one's cost on-policy (none for the three that read the sampler)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.numerics import adam_first_step_tolerance, assert_reordered_close
from tests.helpers.trainers import batch_and_trainer, reorder_terms

from tba.config import ConfigError, ObjectiveConfig, load_config
from tba.objectives import huber_square, m2_keep, normalised_ess, tb_loss, tb_trust_region_keep
from tba.plan.auto import grad_clip as auto_grad_clip
from tba.plan.auto import needs_sampler_logps, stale_by_design, tb_trust_region

T = torch.tensor

PLAIN = ObjectiveConfig(type="tb", beta=0.1, tb_trust_region=None)  # trajectory balance without the band


def _one_prompt(shift: float):
    """K = 2, β = 1: log π = (−1, −3), rewards (1, 0), reference 0, so δ = (−2, −3), log Ẑ = 2.5 and
    the residuals are (0.5, −0.5). Two tokens each; the sampler's token log-probs are the policy's
    minus ``shift``, so ℓ = shift for both completions."""
    token_logp = T([[-0.5, -0.5], [-1.0, -2.0]], requires_grad=True)
    logp = token_logp.sum(1)
    mask = torch.ones(2, 2)
    sampler = token_logp.detach() - shift
    return token_logp, logp, mask, sampler


def test_plain_tb_by_hand():
    _, logp, _, _ = _one_prompt(0.0)
    loss, m = tb_loss(logp, T([0.0, 0.0]), T([1.0, 0.0]), 1.0, 2)
    assert loss.item() == pytest.approx(0.25) and m["log_z_mean"] == pytest.approx(2.5)


def _trust_region_loss(shift: float, tau: float = 0.1, sequence: bool = False):
    token_logp, logp, mask, sampler = _one_prompt(shift)
    loss, metrics = tb_loss(
        logp, T([0.0, 0.0]), T([1.0, 0.0]), 1.0, 2, sampler_token_logp=sampler, token_logp=token_logp, mask=mask,
        trust_region=tau, trust_region_sequence=sequence,
    )  # fmt: skip
    return loss, metrics, token_logp


def test_trust_region_drops_the_term_that_would_push_further_out():
    loss, m, token_logp = _trust_region_loss(0.3)  # π above μ on both: ℓ = 0.3 > τ
    # ε₂ = −0.5 would raise log π(y₂) further above μ: dropped; ε₁ = +0.5 lowers it: kept
    assert loss.item() == pytest.approx(0.25 / 2) and m["tb_dropped"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(token_logp.grad, T([[0.5, 0.5], [0.0, 0.0]]))  # 2ε₁/N on y₁'s tokens
    # inside the band (ℓ = 0.05 ≤ τ) nothing is dropped: the plain loss
    loss, m, _ = _trust_region_loss(0.05)
    assert loss.item() == pytest.approx(0.25) and m["tb_dropped"] == 0.0
    # the rule alone, both directions
    keep = tb_trust_region_keep(T([-1.0, 1.0, -1.0, 1.0, 0.0]), T([0.5, 0.5, -0.5, -0.5, 9.0]), 0.2)
    assert keep.tolist() == [False, True, True, False, True]


def test_sequence_trust_region_measures_the_summed_log_ratio():
    # two tokens each, 0.15 apart per token: ℓ = 0.15 is inside τ = 0.2, the sequence's 0.3 is not
    loss, m, _ = _trust_region_loss(0.15, tau=0.2)
    assert loss.item() == pytest.approx(0.25) and m["tb_dropped"] == 0.0
    loss, m, token_logp = _trust_region_loss(0.15, tau=0.2, sequence=True)
    assert loss.item() == pytest.approx(0.25 / 2) and m["tb_dropped"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(token_logp.grad, T([[0.5, 0.5], [0.0, 0.0]]))  # y₂ (ε < 0, raising) dropped
    # below the sampler by 0.15 per token: now ε₁ > 0 (lowering y₁ further) is the one dropped
    loss, m, token_logp = _trust_region_loss(-0.15, tau=0.2, sequence=True)
    loss.backward()
    torch.testing.assert_close(token_logp.grad, T([[0.0, 0.0], [-0.5, -0.5]]))


def test_m2_mask_drops_the_largest_second_moments_until_the_mean_fits():
    # sorted: 0.25, 0.09, 0.01, 0.0; mean 0.0875 > 0.05; without 0.25: 0.1/3 = 0.033 <= 0.05
    assert m2_keep(T([0.09, 0.01, 0.25, 0.0]), 0.05).tolist() == [True, True, False, True]
    # without 0.25 and 0.09: 0.005 <= 0.02 (without 0.25 alone: 0.033 > 0.02)
    assert m2_keep(T([0.09, 0.01, 0.25, 0.0]), 0.02).tolist() == [False, True, False, True]
    assert m2_keep(T([0.09, 0.01]), 1.0).tolist() == [True, True]
    assert m2_keep(T([0.5, 0.4]), 0.01).tolist() == [False, True]  # one is always kept


def _m2_loss(token_logp, reward, off, group_size, threshold):
    return tb_loss(
        token_logp.sum(1), torch.zeros(len(reward)), T(reward), 1.0, group_size,
        sampler_token_logp=token_logp.detach() - off, token_logp=token_logp, mask=torch.ones_like(off),
        m2_threshold=threshold,
    )  # fmt: skip


def test_m2_mask_takes_log_z_over_the_kept_completions():
    # K = 3, β = 1, reference 0: log π = (−1, −3, −2), rewards (1, 0, 0.5), so δ = (−2, −3, −2.5).
    # y₁'s tokens are 0.5 off the sampler (m = 0.25), the others agree: τ₂ = 0.05 drops y₁, and
    # log Ẑ = 2.75 from y₂, y₃ alone: residuals (·, −0.25, 0.25). (From all three, log Ẑ = 2.5 and
    # the residuals (·, −0.5, 0) would lower neither and raise y₂ alone.)
    token_logp = T([[-0.5, -0.5], [-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    off = T([[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]])
    loss, m = _m2_loss(token_logp, [1.0, 0.0, 0.5], off, 3, 0.05)
    assert loss.item() == pytest.approx(2 * 0.0625 / 3) and m["tb_dropped"] == pytest.approx(1 / 3)
    assert m["log_z_mean"] == pytest.approx(2.75)
    loss.backward()
    g = 2 * 0.25 / 3  # 2ε/N on each token of the completion
    torch.testing.assert_close(token_logp.grad, T([[0.0, 0.0], [-g, -g], [g, g]]))
    # a prompt whose completions are all dropped adds nothing, not even to log_z_mean: two prompts,
    # the second's tokens 0.5 off; its m = 0.25 twice, so τ₂ = 0.05 drops both, and what is left
    # is the first prompt's plain loss (δ = (−2, −3), residuals ±0.5) over N = 4 terms
    token_logp = T([[-0.5, -0.5], [-1.0, -2.0], [-0.5, -0.5], [-1.0, -2.0]], requires_grad=True)
    off = T([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    loss, m = _m2_loss(token_logp, [1.0, 0.0, 9.0, 9.0], off, 2, 0.05)
    assert loss.item() == pytest.approx(2 * 0.25 / 4) and m["tb_dropped"] == pytest.approx(0.5)
    assert m["log_z_mean"] == pytest.approx(2.5)


def test_huber_residual_is_linear_beyond_kappa():
    torch.testing.assert_close(huber_square(T([0.1, -0.5, 2.0]), 0.3), T([0.01, 0.21, 1.11]))
    _, logp, _, _ = _one_prompt(0.0)
    logp.retain_grad()
    loss, m = tb_loss(logp, T([0.0, 0.0]), T([1.0, 0.0]), 1.0, 2, huber=0.3)
    assert loss.item() == pytest.approx(0.21) and m["tb_huber_fraction"] == 1.0
    loss.backward()
    torch.testing.assert_close(logp.grad, T([0.3, -0.3]))  # 2κ·sign(ε)/N


def test_normalised_ess_by_hand():
    assert normalised_ess(T([0.0, 0.0, 0.0])) == pytest.approx(1.0)
    # w = (1, e): (1 + e)² / (2 (1 + e²))
    assert normalised_ess(T([0.0, 1.0])) == pytest.approx((1 + math.e) ** 2 / (2 * (1 + math.e**2)))
    assert normalised_ess(T([0.0, -1000.0])) == pytest.approx(0.5)


def _step(tokenizer, objective: ObjectiveConfig, shift: float, lr: float = 1e-3):
    """One optimizer step: how far it moved each weight, its metrics, the trainer, and the
    gradients and weights it started from (flat, for adam_first_step_tolerance)."""
    trainer, batch = batch_and_trainer(tokenizer, objective, shift=shift)
    trainer.optimizer.param_groups[0]["lr"] = lr
    params = list(trainer.model.parameters())
    before = [p.detach().clone() for p in params]
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        )
    )
    metrics = trainer.update(batch)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)])
    return delta, metrics, trainer, (seen[0], torch.cat([b.flatten() for b in before]))


def assert_same_adam_step(variant, plain, trainer, start, lr: float = 1e-3) -> None:
    """Two first AdamW steps whose gradients differ only by rounding: equal up to what Adam's
    normalisation makes of it (tests/helpers/numerics.py: adam_first_step_tolerance)."""
    grad, weight = start
    bound = adam_first_step_tolerance(grad, weight, lr, reorder_terms(trainer))
    assert ((variant.double() - plain.double()).abs() <= bound).all()


@pytest.mark.parametrize(
    "setting",
    [
        {},  # the default: the sequence band (tb_trust_region auto, 0.5)
        {"tb_trust_region": 0.2, "tb_trust_region_sequence": False},
        {"tb_trust_region": 0.2},
        {"tb_m2_threshold": 0.04, "tb_trust_region": None},
        {"tb_ess_lr": True, "tb_trust_region": None},
    ],
    ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items()) or "default",
)
def test_on_policy_the_variants_take_the_plain_tb_step(tokenizer, setting):
    plain, _, _, _ = _step(tokenizer, PLAIN, 0.0)
    variant, metrics, trainer, start = _step(tokenizer, ObjectiveConfig(type="tb", beta=0.1, **setting), 0.0)
    assert trainer.sampler_logps
    assert plain.abs().max() > 0
    assert_same_adam_step(variant, plain, trainer, start)
    if "tb_ess_lr" in setting:
        assert metrics["train/tb_ess"] == pytest.approx(1.0)
    else:
        assert metrics["train/tb_dropped"] == 0.0


def test_trainer_passes_the_sequence_band(tokenizer):
    """Sampler 0.15 below the trainer per token, completions of 2-3 tokens: inside a per-token band
    of 0.2, outside a sequence band of 0.2, so only the sequence setting drops terms (those whose
    residual is negative, about half)."""
    per_token = ObjectiveConfig(type="tb", beta=0.1, tb_trust_region=0.2, tb_trust_region_sequence=False)
    _, metrics, _, _ = _step(tokenizer, per_token, -0.15)
    assert metrics["train/tb_dropped"] == 0.0
    sequence = ObjectiveConfig(type="tb", beta=0.1, tb_trust_region=0.2, tb_trust_region_sequence=True)
    _, metrics, trainer, _ = _step(tokenizer, sequence, -0.15)
    assert 0.0 < metrics["train/tb_dropped"] < 1.0
    # a variant that reads the sampler logs how far the policy is from it, as the ratio objectives do
    _, batch = batch_and_trainer(tokenizer, sequence, -0.15)
    scale = max(abs(t) for r in batch.rollouts for t in r.sampler_token_logps)
    assert_reordered_close(metrics["train/sampler_logp_diff"], 0.15, terms=reorder_terms(trainer), scale=scale)
    assert 0.0 < metrics["train/sampler_ess"] < 1.0  # sequence lengths differ: so do their weights e^(0.15|y|)


def test_ess_lr_scales_the_step_by_the_batch_ess(tokenizer):
    """Sampler log-probs log 2 below the trainer's per token: sequences of different lengths get
    different weights 2^|y|, the batch's ESS is below 1, and the step equals a plain TB step whose
    learning rate is lr x ESS."""
    variant, metrics, trainer, start = _step(
        tokenizer, ObjectiveConfig(type="tb", beta=0.1, tb_ess_lr=True, tb_trust_region=None), -math.log(2)
    )
    _, batch = batch_and_trainer(tokenizer, PLAIN, 0.0)
    lengths = torch.tensor([len(r.completion) for r in batch.rollouts], dtype=torch.float64)
    ess = normalised_ess(lengths * math.log(2))
    assert 0.5 < ess < 1
    # the trainer's ESS from float32 log-prob sums of the 8 completions
    assert_reordered_close(metrics["train/tb_ess"], ess, terms=reorder_terms(trainer))
    plain, _, _, _ = _step(tokenizer, PLAIN, 0.0, lr=1e-3 * ess)
    assert_same_adam_step(variant, plain, trainer, start, lr=1e-3 * ess)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3, rel=1e-4)  # next step: the schedule's again


def test_tb_steps_unclipped_by_default_and_clipped_when_asked(tokenizer):
    """trainer.grad_clip=auto leaves TB's gradient as it is (a clip of 1 would bind on every TB
    step); an explicit clip still applies. Adam's first moment after one step is (1 − β₁)·g, g
    the gradient as the optimizer took it."""

    def first_moment(grad_clip):
        trainer, batch = batch_and_trainer(tokenizer, PLAIN, shift=0.0)
        trainer.grad_clip = auto_grad_clip(trainer.cfg.model_copy(update={"grad_clip": grad_clip}), "tb")
        metrics = trainer.update(batch)
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        moment = torch.cat([trainer.optimizer.state[p]["exp_avg"].flatten() for p in params])
        taken = moment.norm().item() / (1 - trainer.optimizer.defaults["betas"][0])
        return metrics, taken, len(moment)

    unclipped, taken, n = first_moment("auto")
    norm = unclipped["train/grad_norm"]
    assert norm > 5  # TB's gradient at β = 0.1: far above a clip of 1
    assert "train/clip_scale" not in unclipped  # no clip, no factor
    # two fp32 norms of the same n numbers, one of them scaled by 1 − β₁ and back
    assert_reordered_close(taken, norm, terms=n, scale=norm)
    clipped_metrics, clipped, _ = first_moment(1.0)
    assert clipped_metrics["train/grad_norm"] == norm  # logged before clipping: the same computation
    assert_reordered_close(clipped, 1.0, terms=n)
    assert clipped_metrics["train/clip_scale"] == pytest.approx(1.0 / norm, rel=1e-5)  # 1e-6 added to the norm
    assert first_moment(10 * norm)[0]["train/clip_scale"] == 1.0  # a clip above the norm does not bind


def test_variants_are_tb_settings():
    with pytest.raises(ConfigError, match="objective.tb_trust_region.*objective.type=tb"):
        load_config(None, ["--objective.type=grpo", "--objective.tb_trust_region=0.2"])
    with pytest.raises(ConfigError, match="tb_trust_region must be positive"):
        load_config(None, ["--objective.tb_trust_region=0"])

    # the default: the sequence band for tb, nothing for the others (no error either)
    def band(overrides: list[str]) -> float | None:
        cfg = load_config(None, overrides)
        return tb_trust_region(cfg.objective, stale_by_design(cfg))

    def needs(objective: ObjectiveConfig, stale: bool = True) -> bool:
        return needs_sampler_logps(objective, tb_trust_region(objective, stale))

    assert band([]) == 0.5 and load_config(None, []).objective.tb_trust_region_sequence
    assert band(["--objective.type=grpo"]) is None
    # the ray runtime and sync with lagging searchers: the band; sync on-policy: plain TB
    assert band(["--runtime.type=ray"]) == band(["--runtime.type=sync", "--runtime.extra_lag=2"]) == 0.5
    assert band(["--runtime.type=sync"]) is None
    assert not needs(load_config(None, ["--runtime.type=sync"]).objective, stale=False)
    assert band(["--runtime.type=sync", "--objective.tb_trust_region=0.2"]) == 0.2
    assert not needs(ObjectiveConfig(type="online_dpo"))
    assert band(["--objective.tb_trust_region=null"]) is None
    assert not needs(ObjectiveConfig(type="tb", tb_trust_region=None))
    assert not needs(ObjectiveConfig(type="tb", tb_huber=1.0, tb_trust_region=None))  # the residual alone
    assert needs(ObjectiveConfig(type="tb", tb_m2_threshold=0.04, tb_trust_region=None))
