"""What the objectives share: the group layout check, group advantages, and the sampler's importance
weights and how far its log-probs are from the trainer's."""

from __future__ import annotations

import math

import torch


def check_groups(n: int, group_size: int, smallest: int = 2) -> None:
    """``n`` completions make whole groups of ``group_size`` (at least ``smallest``: a baseline
    compares the completions of a group, so 2), else a ValueError that says how to lay them out."""
    if n == 0:
        raise ValueError("empty batch")
    if group_size < smallest or n % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {n} completions (or is below {smallest}); "
            f"pass the K completions of each prompt consecutively"
        )


def group_advantages(reward: torch.Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """``r − mean`` over each group, divided by the group's std (+eps) when ``normalize_std``."""
    r = reward.view(-1, group_size)  # [B, K]
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def truncated_is_weights(
    old_token_logp: torch.Tensor, sampler_token_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Per-token truncated importance weights ``min(exp(log π_old − log π_sampler), cap)``, 0 off the
    mask, ``[N, T]``, without gradient."""
    with torch.no_grad():
        return torch.exp((old_token_logp - sampler_token_logp) * mask).clamp(max=cap) * mask


def sequence_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level truncated importance weights ``min(exp(log π_old(y) − log π_sampler(y)), cap)``, ``[N]``."""
    with torch.no_grad():
        return torch.exp((old_logp - sampler_logp).clamp(max=math.log(cap)))


def sampler_mismatch(
    old_token_logp: torch.Tensor, sampler_token_logp: torch.Tensor, mask: torch.Tensor, cap: float | None = None
) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's at the step's start, over the masked tokens:

            sampler_logp_diff = mean_t |log π_old(y_t) − log π_sampler(y_t)|
            sampler_logp_bias = mean_t (log π_old(y_t) − log π_sampler(y_t))
            sampler_ess       = (Σ_i w_i)² / (N · Σ_i w_i²),  w_i = Π_t π_old(y_it)/π_sampler(y_it)

    ``sampler_logp_bias`` tells which side is off where ``sampler_logp_diff`` cannot: rounding and
    kernel noise (bf16 logits on either side) average out near 0, while a sampler whose log-probs come
    from a flatter distribution than the policy's (temperature or top-p applied before the log-softmax:
    the sampled tokens are the likely ones, which flattening makes less likely) gives a positive bias.

        ``sampler_ess`` is the effective sample size of the N sequences' importance weights as a
        fraction of N: 1 when the two agree, 1/N when one sequence carries all the weight. With ``cap``
        also ``tis_truncated``, the fraction of tokens whose weight the cap truncated."""
    with torch.no_grad():
        diff = (old_token_logp - sampler_token_logp) * mask
        tokens = mask.sum().clamp(min=1)
        log_w = diff.sum(dim=1).double()  # [N]
        ess = torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)) / log_w.numel()
        metrics = {
            "sampler_logp_diff": (diff.abs().sum() / tokens).item(),
            "sampler_logp_bias": (diff.sum() / tokens).item(),
            "sampler_ess": ess.item(),
        }
        if cap is not None:
            metrics["tis_truncated"] = (((diff > math.log(cap)) & (mask > 0)).sum() / tokens).item()
    return metrics
