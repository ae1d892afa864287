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

The package: :mod:`~tba.objectives.tb` (trajectory balance and its variants),
:mod:`~tba.objectives.baselines`, :mod:`~tba.objectives.common` (group layout, advantages,
importance weights) and :mod:`~tba.objectives.dispatch` (the configured objective on a micro-batch,
what the trainer calls).
"""

from tba.objectives.baselines import (
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    ppo_loss,
    rloo_loss,
    shaped_reward,
)
from tba.objectives.common import (
    group_advantages,
    sampler_mismatch,
    sequence_is_weights,
    truncated_is_weights,
)
from tba.objectives.dispatch import objective_loss, sampler_token_logps
from tba.objectives.needs import Needs, needs
from tba.objectives.tb import huber_square, m2_keep, normalised_ess, tb_loss, tb_trust_region_keep

__all__ = [
    "Needs",
    "needs",
    "dr_grpo_loss",
    "group_advantages",
    "grpo_loss",
    "huber_square",
    "m2_keep",
    "normalised_ess",
    "objective_loss",
    "online_dpo_loss",
    "ppo_loss",
    "rloo_loss",
    "sampler_mismatch",
    "sampler_token_logps",
    "sequence_is_weights",
    "shaped_reward",
    "tb_loss",
    "tb_trust_region_keep",
    "truncated_is_weights",
]
