"""The configured objective on one micro-batch: ``objective.type`` and its settings picked once per
call, the sampler's token log-probs gathered where the objective needs them. What the trainer calls."""

from __future__ import annotations

import torch

from tba.config import ObjectiveConfig
from tba.objectives.baselines import dr_grpo_loss, grpo_loss, online_dpo_loss, ppo_loss, rloo_loss
from tba.objectives.common import sampler_mismatch, sequence_is_weights, truncated_is_weights
from tba.objectives.tb import tb_loss
from tba.types import Rollout, is_flat


def objective_loss(
    o: ObjectiveConfig,
    token_logp: torch.Tensor,
    mask: torch.Tensor,
    logp: torch.Tensor,
    ref: torch.Tensor,
    reward: torch.Tensor,
    rollouts: list[Rollout],
    beta: float,
    group_size: int,
    max_tokens: int,
    trust_region: float | None = None,
    sampler_logps: bool = False,
    log_w: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective ``o`` configures on one micro-batch of whole groups: ``token_logp`` and ``mask``
    ``[N, T]`` (the policy's, with gradient), ``logp`` their sums, ``ref`` and ``reward`` ``[N]``,
    the ``rollouts`` they came from (the sampler's token log-probs, when the objective needs them),
    ``group_size`` K, ``max_tokens`` Dr. GRPO's constant. ``trust_region``: TB's band, resolved
    (:func:`tba.plan.auto.tb_trust_region`); ``sampler_logps``: whether the rollouts carry the
    sampler's token log-probs the objective uses (:func:`tba.plan.auto.needs_sampler_logps`).
    ``log_w``: with ``objective.tb_ess_lr``,
    the sequences' log importance weights are appended to it (the step scales its learning rate
    by their effective sample size)."""
    k = group_size
    if o.type == "tb":
        sampler = sampler_token_logps(rollouts, mask) if sampler_logps else None
        if o.tb_ess_lr and log_w is not None:  # the sequences' log importance weights, for the step's lr
            log_w.append(((token_logp.detach() - sampler) * mask).sum(1))
        loss, m = tb_loss(
            logp,
            ref,
            reward,
            beta,
            k,
            scale_beta_sq=o.scale_beta_sq,
            sampler_token_logp=sampler,
            token_logp=token_logp,
            mask=mask,
            trust_region=trust_region,
            trust_region_sequence=o.tb_trust_region_sequence,
            m2_threshold=o.tb_m2_threshold,
            huber=o.tb_huber,
        )
        if sampler is not None:  # how far the trained policy has moved from the data's sampler
            m.update(sampler_mismatch(token_logp.detach(), sampler, mask))
        return loss, m
    if o.type == "online_dpo":
        contrast = [not is_flat([r.reward for r in rollouts[i : i + k]]) for i in range(0, len(rollouts), k)]
        return online_dpo_loss(logp, ref, reward, beta, k, contrast=contrast)
    if o.type == "rloo" and not sampler_logps:
        return rloo_loss(logp, ref, reward, beta, k)
    sampler = sampler_token_logps(rollouts, mask)  # [G*K, T]
    current = token_logp.detach()  # the trainer's log-probs at the step's start
    mismatch = sampler_mismatch(current, sampler, mask, o.tis_cap)
    if o.tis_cap is None:  # the ratio is to the sampler, clipped
        old, weight = sampler, None
    else:  # the ratio is to the trainer's own log-probs; the sampler enters through capped weights
        old = current
        weight = (
            sequence_is_weights(current.sum(-1), sampler.sum(-1), o.tis_cap)
            if o.type == "rloo"
            else truncated_is_weights(current, sampler, mask, o.tis_cap)
        )
    if o.type == "rloo":
        clip = o.clip_eps if o.rloo_proximal else None
        loss, m = rloo_loss(logp, ref, reward, beta, k, sampler_logp=old.sum(-1), clip_eps=clip, is_weight=weight)
    elif o.type == "grpo":
        loss, m = grpo_loss(
            token_logp, old, mask, reward, k, o.clip_eps, ref_logp=ref, kl_coef=o.kl_coef, is_weight=weight
        )
    elif o.type == "dr_grpo":
        loss, m = dr_grpo_loss(token_logp, old, mask, reward, k, max_tokens, o.clip_eps, is_weight=weight)
    elif o.type == "ppo":
        loss, m = ppo_loss(token_logp, old, mask, reward, ref, beta, k, o.clip_eps, is_weight=weight)
    else:
        raise ValueError(f"unknown objective.type {o.type!r}")
    return loss, {**m, **mismatch}


def sampler_token_logps(rollouts: list[Rollout], mask: torch.Tensor) -> torch.Tensor:
    """The sampler's per-token log-probs of ``rollouts``, ``[N, T]`` like ``mask`` (0 off it)."""
    out = torch.zeros(mask.shape, dtype=mask.dtype)  # filled on the host, moved once (not a copy per rollout)
    for i, r in enumerate(rollouts):
        if r.sampler_token_logps is None:
            raise ValueError(
                "this objective needs the sampler's per-token log-probs, and a rollout in the buffer has none "
                "(it came from a searcher or checkpoint made for another objective)"
            )
        n = len(r.sampler_token_logps)
        out[i, :n] = torch.tensor(r.sampler_token_logps, dtype=out.dtype)
    return out.to(mask.device) * mask
