"""Trajectory balance (VarGrad form) and its staleness-aware variants: the Huber residual, the
trust bands on the log-ratio to the sampler, the second-moment filter, the ESS learning-rate scale."""

from __future__ import annotations

import torch

from tba.objectives.common import check_groups


def tb_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    group_size: int,
    scale_beta_sq: bool = False,
    sampler_token_logp: torch.Tensor | None = None,
    token_logp: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    trust_region: float | None = None,
    trust_region_sequence: bool = False,
    m2_threshold: float | None = None,
    huber: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Trajectory balance loss with the per-prompt VarGrad estimate of log Z.

    ``scale_beta_sq`` multiplies the loss by β², so the step on the reward term does not grow
    as 1/β while β is annealed down (the paper's code does not; off by default).

    Variants for stale data (each off by default). With the residual ε_j = log Ẑ(x) + δ_j, the
    sampler μ's per-token log-probs (``sampler_token_logp``, ``[N, T]``, with the policy's
    ``token_logp`` and ``mask``) and the length-normalised sequence log-ratio
    ℓ_j = (1/|y_j|) Σ_t (log π_θ(y_jt) − log μ(y_jt)), taken at the step's start (no gradient):

    - ``trust_region`` τ (:func:`tb_trust_region_keep`): a completion's term is dropped when its
      gradient would move π further out of the band |ℓ| ≤ τ: ε_j < 0 (the gradient raises
      log π(y_j)) with ℓ_j > τ, or ε_j > 0 (it lowers log π(y_j)) with ℓ_j < −τ. PPO's clip, carried
      to the TB residual, whose sign plays the advantage's part. loss = mean_j keep_j · ε_j².
      With ``trust_region_sequence`` the band is on the sequence log-ratio L_j = |y_j|·ℓ_j instead
      (what proximal RLOO clips): a per-token band of τ lets a sequence of |y| tokens move its
      probability by up to e^(τ|y|), a sequence band by e^τ whatever its length.
    - ``m2_threshold`` τ₂ (:func:`m2_keep`, after M2PO): m_j = (1/|y_j|) Σ_t (log π_θ − log μ)²
      is each completion's second moment of token log-ratios; the completions with the largest
      m_j are dropped until the mean of m over those kept is at most τ₂, and log Ẑ(x) is the mean of
      −δ over the kept completions of x only (the mask does not depend on ε, so it can come first):
      the kept residuals of a prompt sum to zero, as without the mask. loss = mean_j keep_j · ε_j².
    - ``huber`` κ: ε² becomes the Huber form h(ε) = ε² for |ε| ≤ κ, 2κ|ε| − κ² beyond (its
      gradient 2·clip(ε, −κ, κ)·∇log π): no completion moves the policy by more than a residual of κ.

    Dropped terms count in the mean (as zeros), so the kept ones weigh what they weigh without the
    variant. On-policy data (π_θ = μ: ℓ = m = 0) keeps every term: the first two cost nothing there.

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
    check_groups(n, group_size, smallest=1)  # one completion a prompt: log Z is its own residual
    if not beta > 0:  # also rejects NaN
        raise ValueError(f"beta must be positive, got {beta}")
    ref_logp = ref_logp.to(logp.dtype)
    reward = reward.to(logp.dtype)

    delta = (logp - ref_logp - reward / beta).view(-1, group_size)  # [B, K]
    keep = torch.ones(n, dtype=torch.bool, device=logp.device)
    metrics: dict[str, float] = {}
    token_ratio = lengths = None
    if trust_region is not None or m2_threshold is not None:
        if sampler_token_logp is None or token_logp is None or mask is None:
            raise ValueError("tb_loss's trust_region and m2_threshold need sampler_token_logp, token_logp and mask")
        with torch.no_grad():
            token_ratio = (token_logp.detach() - sampler_token_logp.to(token_logp.dtype)) * mask
            lengths = mask.sum(dim=1).clamp(min=1)
            if m2_threshold is not None:
                keep &= m2_keep(token_ratio.pow(2).sum(1) / lengths, m2_threshold)
    kept = keep.view_as(delta).to(delta.dtype)  # [B, K]
    counted = kept.sum(dim=1, keepdim=True)  # [B, 1]: 0 only where M2 dropped the whole group
    log_z = -(delta.detach() * kept).sum(dim=1, keepdim=True) / counted.clamp(min=1)  # [B, 1]
    residual = log_z + delta  # [B, K]
    per = residual.pow(2) if huber is None else huber_square(residual, huber)
    if trust_region is not None:  # after log Ẑ: the band reads the residual's sign
        with torch.no_grad():
            ratio = token_ratio.sum(1) if trust_region_sequence else token_ratio.sum(1) / lengths
            keep &= tb_trust_region_keep(residual.detach().reshape(-1), ratio, trust_region)
    if token_ratio is not None:
        per = per * keep.view_as(per).to(per.dtype)
        metrics["tb_dropped"] = 1.0 - keep.float().mean().item()
    loss = per.mean()
    if scale_beta_sq:
        loss = loss * beta**2

    with torch.no_grad():
        kl = (logp - ref_logp).mean()
        metrics.update(
            {
                "log_z_mean": log_z[counted > 0].mean().item(),
                "residual_std": residual.std().item() if n > 1 else 0.0,
                "kl": kl.item(),
            }
        )
        if huber is not None:
            metrics["tb_huber_fraction"] = (residual.abs() > huber).float().mean().item()
    return loss, metrics


def huber_square(residual: torch.Tensor, kappa: float) -> torch.Tensor:
    """ε² for |ε| ≤ κ, 2κ|ε| − κ² beyond: equal to ε² and its slope at |ε| = κ, linear after."""
    if not kappa > 0:
        raise ValueError(f"huber kappa must be positive, got {kappa}")
    a = residual.abs()
    return torch.where(a <= kappa, residual.pow(2), 2 * kappa * a - kappa**2)


def tb_trust_region_keep(residual: torch.Tensor, seq_log_ratio: torch.Tensor, tau: float) -> torch.Tensor:
    """``[N]`` bool: False where the TB gradient would push the policy further out of |ℓ| ≤ τ
    (ℓ the log-ratio to the sampler, per token or per sequence)
    (ε < 0 raises log π(y): dropped when ℓ > τ; ε > 0 lowers it: dropped when ℓ < −τ)."""
    raises, lowers = residual < 0, residual > 0
    return ~((raises & (seq_log_ratio > tau)) | (lowers & (seq_log_ratio < -tau)))


def m2_keep(second_moment: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[N]`` bool: drop the entries of ``second_moment`` from the largest down, the fewest that
    bring the mean of those kept to at most ``threshold`` (M2PO's rule, per sequence)."""
    n = second_moment.numel()
    order = torch.argsort(second_moment, descending=True, stable=True)
    ordered = second_moment[order].double()
    kept_sum = ordered.sum() - torch.cat([ordered.new_zeros(1), ordered.cumsum(0)[:-1]])  # without the top j
    kept_n = torch.arange(n, 0, -1, device=ordered.device, dtype=ordered.dtype)
    fits = (kept_sum / kept_n) <= threshold  # dropping the top j is enough
    drop = int(torch.nonzero(fits)[0].item()) if bool(fits.any()) else n - 1  # always keep one
    keep = torch.ones(n, dtype=torch.bool, device=second_moment.device)
    keep[order[:drop]] = False
    return keep


def normalised_ess(log_w: torch.Tensor) -> float:
    """(Σ w)² / (N · Σ w²) of weights given as logs: 1 when they are equal, 1/N when one carries all."""
    log_w = log_w.double()
    return torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)).item() / log_w.numel()
