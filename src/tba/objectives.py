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

The baselines, in the same engine so that one config key switches between them:

    grpo        group-normalised advantage (r − mean)/std, per-token clipped ratio against the
                sampler's log-probs, mean over each sequence's tokens; optional KL to the reference
    dr_grpo     advantage r − mean (no std), token sum divided by a constant (Liu et al. 2025)
    ppo         clipped-ratio policy gradient, per token, advantage = KL-shaped reward minus the
                group mean (no value network), sampler log-probs as the behaviour policy
    rloo        REINFORCE with the leave-one-out baseline on the KL-shaped reward
                r − β·(log π − log π_ref); ``proximal=True`` clips the sequence ratio (Proximal RLOO)
    online_dpo  per group, highest- against lowest-reward completion, DPO loss against the reference

Sampler/trainer mismatch. The ratio objectives take the sampler's per-token log-probs, which come
from a stale policy and, with vLLM, from other kernels than the trainer's. By default they are the
ratio's denominator (clipped, PPO's trust region around the sampler). With ``objective.tis_cap`` C
they are corrected as verl and TRL correct vLLM's (truncated importance sampling, Yao et al. 2025):
the clipped ratio is taken against the trainer's own log-probs at the step's start, π_old, and each
token's term is multiplied by w_t = min(π_old(y_t)/π_sampler(y_t), C), with no gradient through w
(:func:`truncated_is_weights`; for RLOO, a sequence-level ratio objective, w = min(Π_t π_old/π_sampler,
C)). With one optimizer step per batch, as here, π_θ = π_old when the step starts, so the clip does
not bind: the capped weight alone carries the correction (AReaL's decoupled objective, with the
proximal policy at the step's start). :func:`sampler_mismatch` measures how far apart the two are.

Per-token tensors are ``[N, T]`` with a ``[N, T]`` mask (1 on completion tokens up to and
including EOS); sequence tensors are ``[N]``; the K completions of a prompt are consecutive.
"""

from __future__ import annotations

import math

import torch

from tba.types import is_flat


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


def _check_groups(n: int, group_size: int) -> None:
    if n == 0:
        raise ValueError("empty batch")
    if group_size < 2 or n % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {n} completions (or is below 2); "
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
    _check_groups(token_logp.shape[0], group_size)
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
    _check_groups(token_logp.shape[0], group_size)
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
    _check_groups(token_logp.shape[0], group_size)
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
    _check_groups(logp.shape[0], group_size)
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
    _check_groups(logp.shape[0], group_size)
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
