"""Trajectory balance loss (VarGrad log Z): values, gradients, grouping and argument checks."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close

from tba.objectives import tb_loss

F64 = torch.float64

# Hand-worked example: B=2 prompts, K=2 completions each, β = 0.5 (all numbers exact in binary).
#
#   j  group  logp   ref    r     δ_j = logp − ref − r/β
#   0    0    -1.0  -1.5   1.0    -1.0 + 1.5 − 2.0 = -1.5
#   1    0    -2.0  -1.0   0.0    -2.0 + 1.0 − 0.0 = -1.0
#   2    1    -0.5  -1.0   0.5    -0.5 + 1.0 − 1.0 = -0.5
#   3    1    -3.0  -2.0   2.0    -3.0 + 2.0 − 4.0 = -5.0
#
#   log Ẑ_0 = −mean(-1.5, -1.0) = 1.25      residuals log Ẑ + δ: -0.25, 0.25
#   log Ẑ_1 = −mean(-0.5, -5.0) = 2.75      residuals log Ẑ + δ:  2.25, -2.25
#   loss = (0.0625 + 0.0625 + 5.0625 + 5.0625) / 4 = 10.25 / 4 = 2.5625
#   log_z_mean = (1.25 + 2.75) / 2 = 2.0
#   kl = mean(logp − ref) = mean(0.5, -1.0, 0.5, -1.0) = -0.25
#   residual_std (unbiased) = sqrt(10.25 / 3)
#   d loss / d logp_j = (2 / (B·K)) · residual_j = 0.5 · residual_j = -0.125, 0.125, 1.125, -1.125
LOGP = [-1.0, -2.0, -0.5, -3.0]
REF = [-1.5, -1.0, -1.0, -2.0]
REWARD = [1.0, 0.0, 0.5, 2.0]
BETA = 0.5
K = 2


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    return logp, torch.tensor(REF, dtype=F64), torch.tensor(REWARD, dtype=F64)


def random_batch(b: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -5.0 * torch.rand(b * k, generator=gen, dtype=F64)
    ref = -5.0 * torch.rand(b * k, generator=gen, dtype=F64)
    reward = torch.randn(b * k, generator=gen, dtype=F64)
    return logp, ref, reward


def grad_wrt_logp(logp: torch.Tensor, ref: torch.Tensor, reward: torch.Tensor, beta: float, k: int) -> torch.Tensor:
    logp = logp.detach().clone().requires_grad_(True)
    loss, _ = tb_loss(logp, ref, reward, beta, k)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def vargrad_not_detached(logp: torch.Tensor, ref: torch.Tensor, reward: torch.Tensor, beta: float, k: int):
    """Reference implementation in which gradient flows through log Ẑ = −mean δ."""
    delta = (logp - ref - reward / beta).view(-1, k)
    log_z = -delta.mean(dim=1, keepdim=True)
    return (log_z + delta).pow(2).mean()


# --- values -------------------------------------------------------------------------------------


def test_hand_computed_loss_and_metrics() -> None:
    logp, ref, reward = example()
    loss, metrics = tb_loss(logp, ref, reward, BETA, K)
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(2.5625, abs=1e-12)
    assert metrics["log_z_mean"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["kl"] == pytest.approx(-0.25, abs=1e-12)
    assert metrics["residual_std"] == pytest.approx((10.25 / 3) ** 0.5, abs=1e-12)


def test_hand_computed_gradient() -> None:
    logp, ref, reward = example()
    loss, _ = tb_loss(logp, ref, reward, BETA, K)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.125, 0.125, 1.125, -1.125], dtype=F64), rtol=0, atol=1e-12)


def test_one_group_of_four_gives_a_different_hand_computed_loss() -> None:
    # Same data, K=4: δ = (-1.5, -1.0, -0.5, -5.0), log Ẑ = 2.0, residuals (0.5, 1.0, 1.5, -3.0),
    # loss = (0.25 + 1 + 2.25 + 9) / 4 = 3.125.
    logp, ref, reward = example()
    loss, metrics = tb_loss(logp, ref, reward, BETA, 4)
    assert loss.item() == pytest.approx(3.125, abs=1e-12)
    assert metrics["log_z_mean"] == pytest.approx(2.0, abs=1e-12)


def test_loss_is_zero_at_the_target_distribution() -> None:
    # logp = ref + r/β + c(x) (any per-prompt constant: the log-normaliser) is the minimiser.
    _, ref, reward = random_batch(3, 4, seed=1)
    offsets = torch.tensor([0.3, -2.0, 5.0], dtype=F64).repeat_interleave(4)
    logp = ref + reward / 0.2 + offsets
    loss, metrics = tb_loss(logp, ref, reward, 0.2, 4)
    assert loss.item() == pytest.approx(0.0, abs=1e-20)
    # log Ẑ = −mean δ = −c(x)
    assert metrics["log_z_mean"] == pytest.approx(-offsets.mean().item(), abs=1e-12)


def test_per_prompt_reward_offsets_are_absorbed_by_log_z() -> None:
    logp, ref, reward = random_batch(3, 4, seed=2)
    shifted = reward + torch.tensor([1.0, -7.0, 30.0], dtype=F64).repeat_interleave(4)
    loss, _ = tb_loss(logp, ref, reward, 0.3, 4)
    loss_shifted, _ = tb_loss(logp, ref, shifted, 0.3, 4)
    # the offsets (up to 30 / β = 100 in δ) cancel in the residuals: the summands are that large
    assert_reordered_close(loss_shifted, loss, dtype=F64, terms=12, scale=(30.0 / 0.3) ** 2)
    # the same offsets over a single group of all 12 completions are not constant, so they matter
    loss_one_group, _ = tb_loss(logp, ref, reward, 0.3, 12)
    loss_one_group_shifted, _ = tb_loss(logp, ref, shifted, 0.3, 12)
    assert abs(loss_one_group_shifted.item() - loss_one_group.item()) > 1.0


def test_beta_scales_the_reward_term() -> None:
    # With logp == ref, δ = −r/β, so the loss is mean((r − mean_group r)²) / β².
    _, ref, reward = random_batch(2, 3, seed=3)
    centred = reward.view(2, 3) - reward.view(2, 3).mean(dim=1, keepdim=True)
    for beta in (0.1, 1.0, 4.0):
        loss, metrics = tb_loss(ref.clone(), ref, reward, beta, 3)
        assert loss.item() == pytest.approx(centred.pow(2).mean().item() / beta**2, rel=1e-12)
        assert metrics["kl"] == pytest.approx(0.0, abs=1e-15)


def test_ref_and_reward_are_cast_to_the_policy_dtype() -> None:
    logp, ref, reward = example()
    loss, _ = tb_loss(logp, ref.float(), reward.float(), BETA, K)
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(2.5625, abs=1e-12)


# --- gradients ----------------------------------------------------------------------------------


def test_gradient_matches_analytic_form_on_random_batch() -> None:
    b, k, beta = 3, 4, 0.25
    logp, ref, reward = random_batch(b, k, seed=4)
    grad = grad_wrt_logp(logp, ref, reward, beta, k)
    delta = (logp - ref - reward / beta).view(b, k)
    residual = (delta - delta.mean(dim=1, keepdim=True)).view(-1)
    assert_reordered_close(grad, 2.0 / (b * k) * residual, dtype=F64, terms=b * k)
    # per group, the gradient sums to zero (log Ẑ is the group mean), up to the sum's rounding
    sums = grad.view(b, k).sum(dim=1)
    assert_reordered_close(sums, torch.zeros(b, dtype=F64), dtype=F64, terms=b * k, scale=grad.abs().max())


def test_policy_parameter_gradients_follow_the_chain_rule() -> None:
    # A tiny "policy": a linear layer producing logits over V tokens; a completion is one token.
    b, k, vocab, dim, beta = 3, 4, 5, 6, 0.5
    torch.manual_seed(0)
    policy = torch.nn.Linear(dim, vocab, dtype=F64)
    features = torch.randn(b * k, dim, dtype=F64)
    tokens = torch.randint(0, vocab, (b * k,))
    ref = -torch.rand(b * k, dtype=F64) * 3
    reward = torch.randn(b * k, dtype=F64)

    def logp_fn() -> torch.Tensor:
        return torch.log_softmax(policy(features), dim=-1).gather(1, tokens[:, None]).squeeze(1)

    params = list(policy.parameters())
    loss, _ = tb_loss(logp_fn(), ref, reward, beta, k)
    grads = torch.autograd.grad(loss, params)

    logp = logp_fn()
    delta = (logp - ref - reward / beta).view(b, k)
    residual = (delta - delta.mean(dim=1, keepdim=True)).view(-1).detach()
    surrogate = (2.0 / (b * k)) * (residual * logp).sum()
    expected = torch.autograd.grad(surrogate, params)

    assert any(g.abs().max() > 1e-3 for g in grads)
    for got, want in zip(grads, expected, strict=True):
        assert_reordered_close(got, want, dtype=F64, terms=b * k * (dim + vocab))


def test_detached_log_z_gives_the_same_gradient_as_the_full_vargrad() -> None:
    b, k, beta = 4, 3, 0.7
    logp, ref, reward = random_batch(b, k, seed=5)
    grad = grad_wrt_logp(logp, ref, reward, beta, k)

    full = logp.detach().clone().requires_grad_(True)
    full_loss = vargrad_not_detached(full, ref, reward, beta, k)
    (full_grad,) = torch.autograd.grad(full_loss, full)

    loss, _ = tb_loss(logp, ref, reward, beta, k)
    assert_reordered_close(loss, full_loss.detach(), dtype=F64, terms=b * k)
    assert_reordered_close(grad, full_grad, dtype=F64, terms=b * k)

    # ... whereas a log Z that is NOT the group mean (here a fixed constant) gives another gradient:
    # the property is specific to the VarGrad estimate.
    fixed = logp.detach().clone().requires_grad_(True)
    fixed_loss = ((fixed - ref - reward / beta) + 1.0).pow(2).mean()
    (fixed_grad,) = torch.autograd.grad(fixed_loss, fixed)
    assert (fixed_grad - grad).abs().max() > 1e-3


# --- grouping -----------------------------------------------------------------------------------


def test_permuting_within_groups_changes_nothing() -> None:
    b, k, beta = 3, 4, 0.4
    logp, ref, reward = random_batch(b, k, seed=6)
    loss, metrics = tb_loss(logp, ref, reward, beta, k)
    grad = grad_wrt_logp(logp, ref, reward, beta, k)

    gen = torch.Generator().manual_seed(7)
    perm = torch.cat([g * k + torch.randperm(k, generator=gen) for g in range(b)])
    assert not torch.equal(perm, torch.arange(b * k))
    loss_p, metrics_p = tb_loss(logp[perm], ref[perm], reward[perm], beta, k)
    grad_p = grad_wrt_logp(logp[perm], ref[perm], reward[perm], beta, k)

    assert_reordered_close(loss_p, loss, dtype=F64, terms=b * k)
    assert_reordered_close(metrics_p, metrics, dtype=F64, terms=b * k)
    unpermuted = torch.empty_like(grad_p)
    unpermuted[perm] = grad_p
    assert_reordered_close(unpermuted, grad, dtype=F64, terms=b * k)


def test_permuting_across_groups_changes_the_loss() -> None:
    # Swap completions 1 (group 0) and 2 (group 1) of the hand-worked example:
    # group 0 δ = (-1.5, -0.5): log Ẑ = 1.0, residuals (-0.5, 0.5)
    # group 1 δ = (-1.0, -5.0): log Ẑ = 3.0, residuals (2.0, -2.0)
    # loss = (0.25 + 0.25 + 4 + 4) / 4 = 2.125  (vs 2.5625 unswapped)
    logp, ref, reward = example()
    perm = torch.tensor([0, 2, 1, 3])
    loss, _ = tb_loss(logp, ref, reward, BETA, K)
    loss_p, metrics_p = tb_loss(logp[perm], ref[perm], reward[perm], BETA, K)
    assert loss.item() == pytest.approx(2.5625, abs=1e-12)
    assert loss_p.item() == pytest.approx(2.125, abs=1e-12)
    assert metrics_p["log_z_mean"] == pytest.approx(2.0, abs=1e-12)


# --- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [3, 5, 0, -2])
def test_group_size_must_divide_the_batch(group_size: int) -> None:
    logp, ref, reward = example()
    with pytest.raises(ValueError, match=rf"group_size {group_size} does not divide the batch of 4"):
        tb_loss(logp, ref, reward, BETA, group_size)


@pytest.mark.parametrize(
    ("logp_shape", "ref_shape", "reward_shape"),
    [((4,), (3,), (4,)), ((4,), (4,), (5,)), ((2, 2), (2, 2), (2, 2)), ((4,), (4, 1), (4,))],
)
def test_shapes_must_be_equal_and_one_dimensional(logp_shape, ref_shape, reward_shape) -> None:
    logp, ref, reward = torch.zeros(logp_shape), torch.zeros(ref_shape), torch.zeros(reward_shape)
    with pytest.raises(ValueError, match=r"1-D tensors of equal length"):
        tb_loss(logp, ref, reward, BETA, 2)


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_beta_must_be_positive(beta: float) -> None:
    logp, ref, reward = example()
    with pytest.raises(ValueError, match=r"beta must be positive"):
        tb_loss(logp, ref, reward, beta, K)


def test_empty_batch_and_nan_beta_are_rejected() -> None:
    empty = torch.zeros(0)
    with pytest.raises(ValueError, match="empty batch"):
        tb_loss(empty, empty, empty, 0.1, 1)
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="beta must be positive"):
        tb_loss(x, x, x, float("nan"), 2)
    with pytest.raises(ValueError, match="1-D"):
        tb_loss(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0), 0.1, 1)
