"""Training objectives: pure tensor functions returning ``(loss, metrics)``.

Trajectory balance, VarGrad form (Bartoldson et al. 2025, after Malkin et al. 2022 and
Richter et al. 2020). For a prompt x with K completions y_1..y_K:

    δ_j     = log π_θ(y_j|x) − log π_ref(y_j|x) − r_j / β
    log Ẑ(x) = −mean_j δ_j                       (detached: no gradient flows through it)
    loss    = mean over all B·K completions of (log Ẑ(x) + δ_j)²

Its minimiser is π*(y|x) ∝ π_ref(y|x)·exp(r(x, y)/β). Any completion, from any older policy, is a
valid sample, which is what lets the trainer learn from a replay buffer. Because log Ẑ is the
mean over the same K samples, detaching it does not change the gradient:
∇loss = (2/(B·K)) Σ_j (log Ẑ + δ_j) ∇log π_θ(y_j|x). The loss is not rescaled by β², as in the
paper's code: when β is annealed down the effective step on the reward term grows as 1/β.
"""

from __future__ import annotations

import torch


def tb_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    group_size: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Trajectory balance loss with the per-prompt VarGrad estimate of log Z.

    Args:
        logp: ``[B*K]`` sequence log-probs under the policy (with gradient).
        ref_logp: ``[B*K]`` sequence log-probs under the reference.
        reward: ``[B*K]`` rewards.
        beta: KL coefficient β > 0.
        group_size: K; the K completions of each prompt are consecutive.
    """
    if logp.dim() != 1 or ref_logp.shape != logp.shape or reward.shape != logp.shape:
        raise ValueError(
            f"tb_loss takes three 1-D tensors of equal length, got shapes "
            f"{tuple(logp.shape)}, {tuple(ref_logp.shape)}, {tuple(reward.shape)}"
        )
    n = logp.shape[0]
    if n == 0:
        raise ValueError("tb_loss got an empty batch")
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {n} completions; "
            f"pass the K completions of each prompt consecutively"
        )
    if not beta > 0:  # also rejects NaN
        raise ValueError(f"beta must be positive, got {beta}")
    ref_logp = ref_logp.to(logp.dtype)
    reward = reward.to(logp.dtype)

    delta = (logp - ref_logp - reward / beta).view(-1, group_size)  # [B, K]
    log_z = -delta.detach().mean(dim=1, keepdim=True)  # [B, 1]
    residual = log_z + delta  # [B, K]
    loss = residual.pow(2).mean()

    with torch.no_grad():
        kl = (logp - ref_logp).mean()
        metrics = {
            "log_z_mean": log_z.mean().item(),
            "residual_std": residual.std().item() if n > 1 else 0.0,
            "kl": kl.item(),
        }
    return loss, metrics
