"""The baseline objectives against hand-computed values, the TB ↔ RLOO gradient identity,
clipping at its boundaries, and masks."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close

from tba.objectives import (
    dr_grpo_loss,
    group_advantages,
    grpo_loss,
    online_dpo_loss,
    ppo_loss,
    rloo_loss,
    tb_loss,
)

T = torch.tensor


def test_group_advantages_by_hand():
    r = T([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])  # groups of 3: means 1/3 and 2
    torch.testing.assert_close(group_advantages(r, 3, False), T([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))
    std1, std2 = math.sqrt(1 / 3), 2.0  # sample std (n - 1)
    expected = T([(2 / 3) / std1, (-1 / 3) / std1, (-1 / 3) / std1, -2 / std2, 0.0, 2 / std2])
    torch.testing.assert_close(group_advantages(r, 3, True, eps=0.0), expected)


def test_grpo_on_policy_by_hand():
    # 2 completions of one prompt, lengths 2 and 1 (second token masked); on-policy: ratio 1
    tok = T([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    reward = T([1.0, 0.0])
    loss, m = grpo_loss(tok, tok.detach(), mask, reward, 2)
    # advantages ±0.5/std, std of [1, 0] = 1/√2 → ±1/√2 (eps 1e-6 aside)
    a = 0.5 / (1 / math.sqrt(2) + 1e-6)
    # surrogate per sequence = mean over its tokens of ratio·A = A; loss = −mean(A_1, A_2) = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    # d/dtok: −(1/2)·A_i/len_i on each unmasked token
    torch.testing.assert_close(tok.grad, T([[-a / 4, -a / 4], [a / 2, 0.0]]))
    assert m["clip_fraction"] == 0 and m["ratio_mean"] == pytest.approx(1.0)


def test_clipping_boundaries():
    eps = 0.2
    mask = T([[1.0], [1.0], [1.0], [1.0]])
    old = T([[0.0], [0.0], [0.0], [0.0]])
    # ratios 1.3 and 0.9 for the positive-advantage completions, 0.7 and 1.1 for the negative ones
    new = torch.log(T([[1.3], [0.7], [0.9], [1.1]])).requires_grad_()
    reward = T([1.0, 0.0, 1.0, 0.0])  # groups of 2: A = +0.5, −0.5 (Dr. GRPO: no std)
    loss, m = dr_grpo_loss(new, old, mask, reward, 2, max_tokens=1, clip_eps=eps)
    # min(ratio·A, clip(ratio)·A): 1.2·0.5, 0.8·(−0.5), 0.9·0.5, 1.1·(−0.5)
    expected = -(1.2 * 0.5 - 0.8 * 0.5 + 0.9 * 0.5 - 1.1 * 0.5) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # clipped terms pass no gradient; unclipped ones pass −A·ratio/(N·max_tokens) w.r.t. log-ratio
    torch.testing.assert_close(new.grad, T([[0.0], [0.0], [-0.5 * 0.9 / 4], [0.5 * 1.1 / 4]]))
    assert m["clip_fraction"] == pytest.approx(0.5)
    # exactly at the boundary the clipped and unclipped terms are equal: not counted as clipped
    at = torch.log(T([[1.2], [0.8], [1.0], [1.0]]))
    _, m = dr_grpo_loss(at, old, mask, reward, 2, max_tokens=1, clip_eps=eps)
    assert m["clip_fraction"] == 0


def test_dr_grpo_divides_token_sums_by_a_constant():
    tok = T([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]], requires_grad=True)
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = dr_grpo_loss(tok, tok.detach(), mask, T([1.0, 0.0]), 2, max_tokens=4)
    loss.backward()
    # A = ±0.5; every unmasked token gets −A/(N·max_tokens) = ∓0.5/8, whatever the sequence length
    torch.testing.assert_close(tok.grad, T([[-1 / 16] * 3, [1 / 16, 0.0, 0.0]]))


def test_masked_tokens_change_nothing():
    torch.manual_seed(0)
    tok = torch.randn(4, 5)
    old = tok + 0.1 * torch.randn(4, 5)
    mask = T([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).float()
    reward, ref = T([1.0, 0.0, 0.5, 0.0]), T([-3.0, -4.0, -1.0, -2.0])
    junk_tok, junk_old = tok.clone(), old.clone()
    junk_tok[mask == 0] = 50.0
    junk_old[mask == 0] = -50.0
    for fn in (
        lambda t, o: grpo_loss(t, o, mask, reward, 2, ref_logp=ref, kl_coef=0.1)[0],
        lambda t, o: dr_grpo_loss(t, o, mask, reward, 2, max_tokens=5)[0],
        lambda t, o: ppo_loss(t, o, mask, reward, ref, 0.1, 2)[0],
    ):
        # callers pass masked tensors (token_logprobs zeroes padding); the losses must not read it
        a = fn(tok * mask, old * mask)
        b = fn(junk_tok * mask, junk_old * mask)
        c = fn(junk_tok, junk_old)
        # padding is multiplied away or masked out: the same sums of the same 2 x 5 terms
        assert_reordered_close(b, a, terms=tok.numel())
        assert_reordered_close(c, a, terms=tok.numel())


def test_ppo_uses_kl_shaped_group_baseline():
    tok = T([[-1.0], [-2.0]], requires_grad=True)
    mask = torch.ones(2, 1)
    ref = T([-1.5, -1.0])
    loss, m = ppo_loss(tok, tok.detach(), mask, T([1.0, 0.0]), ref, beta=0.5, group_size=2)
    # shaped: 1 − 0.5·(−1 + 1.5) = 0.75 and 0 − 0.5·(−2 + 1) = 0.5 → A = ±0.125
    loss.backward()
    torch.testing.assert_close(tok.grad, T([[-0.125 / 2], [0.125 / 2]]))
    assert m["kl"] == pytest.approx(((-1 + 1.5) + (-2 + 1)) / 2)


def test_rloo_leave_one_out_by_hand():
    logp = T([-1.0, -2.0, -3.0], requires_grad=True)
    ref = T([-1.0, -2.0, -3.0])  # no KL: the shaped reward is the reward
    loss, _ = rloo_loss(logp, ref, T([3.0, 0.0, 0.0]), beta=0.1, group_size=3)
    # A = r_j − mean of the others: 3 − 0, 0 − 1.5, 0 − 1.5
    assert loss.item() == pytest.approx(-(3 * -1 + -1.5 * -2 + -1.5 * -3) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, T([-1.0, 0.5, 0.5]))


def test_proximal_rloo_clips_sequence_ratio():
    logp = torch.log(T([1.5, 1.0])).requires_grad_()  # ratios 1.5 and 1 against a sampler at log 1 = 0
    ref = T([0.0, 0.0])
    sampler = T([0.0, 0.0])
    loss, m = rloo_loss(logp, ref, T([1.0, 0.0]), 0.1, 2, sampler_logp=sampler, clip_eps=0.2)
    # shaped rewards from the sampler: 1 and 0 → A = +1, −1; min(1.5·1, 1.2·1) = 1.2; −1·1 = −1
    assert loss.item() == pytest.approx(-(1.2 - 1.0) / 2)
    assert m["clip_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="sampler_logp"):
        rloo_loss(logp, ref, T([1.0, 0.0]), 0.1, 2, clip_eps=0.2)


def test_online_dpo_by_hand():
    logp = T([-1.0, -2.0, -3.0, -1.0, -1.0, -1.0], requires_grad=True)
    ref = T([-1.5, -1.5, -1.5, -1.0, -1.0, -1.0])
    reward = T([0.0, 1.0, 0.5, 1.0, 1.0, 1.0])  # second group: all equal, no pair
    loss, m = online_dpo_loss(logp, ref, reward, beta=2.0, group_size=3)
    # chosen = index 1 (Δ = −0.5), rejected = index 0 (Δ = +0.5): margin = 2·(−1) = −2
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(2))))
    assert m["pairs"] == 1 and m["preference_accuracy"] == 0
    loss.backward()
    s = 1 / (1 + math.exp(-2.0))  # σ(−margin)
    torch.testing.assert_close(logp.grad, T([2 * s, -2 * s, 0.0, 0.0, 0.0, 0.0]))
    none, m = online_dpo_loss(logp[3:], ref[3:], reward[3:], 2.0, 3)
    assert none.item() == 0 and m["pairs"] == 0


def test_on_policy_tb_gradient_is_rloo_gradient_times_constant():
    """On-policy, ∇L_TB = (2(K−1)/(βK))·∇L_RLOO with the KL-shaped reward (paper, appendix)."""
    torch.manual_seed(0)
    b, k, beta = 3, 4, 0.3
    theta = torch.randn(b * k, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(b * k, dtype=torch.float64)
    reward = torch.randint(0, 2, (b * k,)).double()
    (g_tb,) = torch.autograd.grad(tb_loss(theta, ref, reward, beta, k)[0], theta)
    (g_rloo,) = torch.autograd.grad(rloo_loss(theta, ref, reward, beta, k)[0], theta)
    torch.testing.assert_close(g_tb, 2 * (k - 1) / (beta * k) * g_rloo)


def test_tb_beta_squared_scaling():
    logp, ref, reward = T([-1.0, -2.0]), T([-1.5, -1.0]), T([1.0, 0.0])
    plain, _ = tb_loss(logp, ref, reward, 0.5, 2)
    scaled, _ = tb_loss(logp, ref, reward, 0.5, 2, scale_beta_sq=True)
    assert scaled.item() == pytest.approx(plain.item() * 0.25)


@pytest.mark.parametrize("fn", ["grpo", "dr_grpo", "ppo", "rloo", "online_dpo"])
def test_bad_group_size_is_rejected(fn):
    x = torch.zeros(6)
    tok, mask = torch.zeros(6, 2), torch.ones(6, 2)
    calls = {
        "grpo": lambda: grpo_loss(tok, tok, mask, x, 4),
        "dr_grpo": lambda: dr_grpo_loss(tok, tok, mask, x, 4, max_tokens=2),
        "ppo": lambda: ppo_loss(tok, tok, mask, x, x, 0.1, 4),
        "rloo": lambda: rloo_loss(x, x, x, 0.1, 4),
        "online_dpo": lambda: online_dpo_loss(x, x, x, 0.1, 4),
    }
    with pytest.raises(ValueError, match="group_size 4 does not divide"):
        calls[fn]()
