"""The baselines in the same engine: GRPO, Dr. GRPO, PPO (no value network), RLOO (Proximal RLOO)
and Online DPO, each ``(loss, metrics)`` over groups of K consecutive completions."""

from __future__ import annotations

import torch

from tba.objectives.common import check_groups, group_advantages
from tba.types import is_flat


def _clipped_token_surrogate(
    token_logp: torch.Tensor,
    old_token_logp: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    clip_eps: float,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``w·min(ratio·A, clip(ratio)·A)`` (masked to 0; w = 1 unless ``is_weight``) and the
    clipped indicator."""
    log_ratio = (token_logp - old_token_logp) * mask  # [N, T]
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)  # [N, 1]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a
    surrogate = torch.minimum(unclipped, clipped) * mask
    if is_weight is not None:
        surrogate = surrogate * is_weight
    was_clipped = ((clipped < unclipped) & (mask > 0)).float()
    return surrogate, was_clipped


def _ratio_metrics(token_logp, old_token_logp, mask, was_clipped) -> dict[str, float]:
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        ratio = torch.exp((token_logp - old_token_logp) * mask)
        return {
            "clip_fraction": (was_clipped.sum() / n).item(),
            "ratio_mean": ((ratio * mask).sum() / n).item(),
            "ratio_max": (ratio * mask).max().item() if mask.any() else 1.0,
        }


def _seq_kl_k3(seq_logp: torch.Tensor, ref_logp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sequence k3 estimate of KL(π‖π_ref) from the length-averaged log-ratio, ``[N]``.

    Searchers send reference log-probs per sequence, not per token, so this is the k3 estimator
    applied to the mean per-token log-ratio of each sequence (a departure from GRPO's per-token KL).
    """
    d = (ref_logp.to(seq_logp.dtype) - seq_logp) / lengths.clamp(min=1)
    return torch.exp(d) - d - 1


def grpo_loss(
    token_logp: torch.Tensor,
    old_token_logp: torch.Tensor,
    mask: torch.Tensor,
    reward: torch.Tensor,
    group_size: int,
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (Shao et al. 2024): group-normalised advantage, per-token clipped ratio, mean over
    each sequence's tokens, then over sequences; plus ``kl_coef``·KL to the reference if set.
    ``is_weight``: ``[N, T]`` per-token weights (:func:`truncated_is_weights`)."""
    check_groups(token_logp.shape[0], group_size)
    adv = group_advantages(reward.to(token_logp.dtype), group_size, normalize_std=True)
    surrogate, was_clipped = _clipped_token_surrogate(token_logp, old_token_logp, mask, adv, clip_eps, is_weight)
    lengths = mask.sum(dim=1)
    loss = -(surrogate.sum(dim=1) / lengths.clamp(min=1)).mean()
    metrics = _ratio_metrics(token_logp, old_token_logp, mask, was_clipped)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("grpo with kl_coef > 0 needs ref_logp")
        kl = _seq_kl_k3((token_logp * mask).sum(dim=1), ref_logp, lengths).mean()
        loss = loss + kl_coef * kl
        metrics["kl_k3"] = kl.item()
    metrics["advantage_abs_mean"] = adv.abs().mean().item()
    return loss, metrics


def dr_grpo_loss(
    token_logp: torch.Tensor,
    old_token_logp: torch.Tensor,
    mask: torch.Tensor,
    reward: torch.Tensor,
    group_size: int,
    max_tokens: int,
    clip_eps: float = 0.2,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (Liu et al. 2025): advantage r − mean (no std division), per-token clipped
    surrogate summed over tokens and divided by the constant ``max_tokens`` (no length bias).
    ``is_weight``: ``[N, T]`` per-token weights (:func:`truncated_is_weights`)."""
    check_groups(token_logp.shape[0], group_size)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    adv = group_advantages(reward.to(token_logp.dtype), group_size, normalize_std=False)
    surrogate, was_clipped = _clipped_token_surrogate(token_logp, old_token_logp, mask, adv, clip_eps, is_weight)
    loss = -(surrogate.sum(dim=1) / max_tokens).mean()
    metrics = _ratio_metrics(token_logp, old_token_logp, mask, was_clipped)
    metrics["advantage_abs_mean"] = adv.abs().mean().item()
    return loss, metrics


def shaped_reward(reward: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """The KL-shaped reward r − β·(log π − log π_ref), with no gradient through log π."""
    return reward.to(logp.dtype) - beta * (logp.detach() - ref_logp.to(logp.dtype))


def ppo_loss(
    token_logp: torch.Tensor,
    old_token_logp: torch.Tensor,
    mask: torch.Tensor,
    reward: torch.Tensor,
    ref_logp: torch.Tensor,
    beta: float,
    group_size: int,
    clip_eps: float = 0.2,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Asynchronous PPO without a value network: advantage = KL-shaped reward (computed with the
    old policy's log-probs) minus its group mean, per-token clipped ratio, token mean per
    sequence, then the mean over sequences. ``is_weight``: ``[N, T]`` per-token weights."""
    check_groups(token_logp.shape[0], group_size)
    old_seq = (old_token_logp * mask).sum(dim=1)
    adv = group_advantages(shaped_reward(reward, old_seq, ref_logp, beta), group_size, normalize_std=False)
    surrogate, was_clipped = _clipped_token_surrogate(token_logp, old_token_logp, mask, adv, clip_eps, is_weight)
    loss = -(surrogate.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    metrics = _ratio_metrics(token_logp, old_token_logp, mask, was_clipped)
    metrics["kl"] = (old_seq - ref_logp.to(old_seq.dtype)).mean().item()
    return loss, metrics


def rloo_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    group_size: int,
    sampler_logp: torch.Tensor | None = None,
    clip_eps: float | None = None,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RLOO (Ahmadian et al. 2024) on sequence log-probs: A_j = r'_j − mean_{i≠j} r'_i with the
    KL-shaped reward r' (log π taken from ``sampler_logp`` when given, else the current policy),
    loss = −mean(A·log π). With ``clip_eps`` (Proximal RLOO) the sequence ratio
    π/π_sampler is clipped as in PPO: −mean(min(ratio·A, clip(ratio)·A)). ``is_weight``: ``[N]``
    sequence weights multiplying each term (:func:`sequence_is_weights`)."""
    check_groups(logp.shape[0], group_size)
    behaviour = logp if sampler_logp is None else sampler_logp.to(logp.dtype)
    r = shaped_reward(reward, behaviour, ref_logp, beta).view(-1, group_size)  # [B, K]
    k = group_size
    adv = (r - (r.sum(dim=1, keepdim=True) - r) / (k - 1)).reshape(-1)  # leave-one-out baseline
    metrics = {"kl": (behaviour.detach() - ref_logp.to(logp.dtype)).mean().item()}
    w = 1.0 if is_weight is None else is_weight.to(logp.dtype)
    if clip_eps is None:
        return -(w * adv * logp).mean(), metrics
    if sampler_logp is None:
        raise ValueError("proximal rloo (clip_eps set) needs sampler_logp")
    ratio = torch.exp(logp - behaviour)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    metrics["clip_fraction"] = (clipped < unclipped).float().mean().item()
    metrics["ratio_mean"] = ratio.detach().mean().item()
    return -(w * torch.minimum(unclipped, clipped)).mean(), metrics


def online_dpo_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    group_size: int,
    contrast: list[bool] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Online DPO (Guo et al. 2024): in each group the highest-reward completion is chosen and the
    lowest rejected (the first of each on ties); loss = −log σ(β·(Δ_chosen − Δ_rejected)) with
    Δ = log π − log π_ref, averaged over groups whose rewards differ (others carry no preference).
    ``contrast``: per group, whether its rewards differ (:func:`tba.types.is_flat` on the rewards as
    stored; from ``reward`` when None)."""
    check_groups(logp.shape[0], group_size)
    r = reward.view(-1, group_size).to(logp.dtype)
    if contrast is None:
        contrast = [not is_flat(row) for row in reward.view(-1, group_size).tolist()]
    delta = (logp - ref_logp.to(logp.dtype)).view(-1, group_size)  # [B, K]
    chosen, rejected = r.argmax(dim=1, keepdim=True), r.argmin(dim=1, keepdim=True)
    valid = torch.tensor(contrast, dtype=logp.dtype, device=logp.device)  # [B]
    margin = beta * (delta.gather(1, chosen) - delta.gather(1, rejected)).squeeze(1)  # [B]
    losses = -torch.nn.functional.logsigmoid(margin) * valid
    n_valid = valid.sum()
    loss = losses.sum() / n_valid.clamp(min=1)  # 0 with zero gradient when no group has a pair
    with torch.no_grad():
        acc = ((margin > 0).to(logp.dtype) * valid).sum() / n_valid.clamp(min=1)
    return loss, {"pairs": n_valid.item(), "preference_accuracy": acc.item(), "margin_mean": margin.mean().item()}
