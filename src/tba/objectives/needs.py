"""What each objective needs from the rollouts and from the run, declared once: the plan, the
builders and the trainer ask here (:func:`needs`) instead of comparing ``objective.type`` with a
name. Every objective takes groups of K completions a prompt and the reference's log-probs with
each (searchers always send both), and none a value model (PPO here takes the group mean as its
baseline), so what varies is declared: the sampler's log-probs, trajectory balance's own settings,
how the loss averages, the default gradient clip."""

from __future__ import annotations

from dataclasses import dataclass

from tba.config import ObjectiveConfig


@dataclass(frozen=True)
class Needs:
    ratio: bool  # a policy ratio to the sampler: the sampler's per-token log-probs, always
    balance: bool = False  # trajectory balance: the sequence band, its variants, a moving reference (TBA′)
    pairs_only: bool = False  # the loss averages over the groups whose rewards differ (Online DPO's pairs)
    grad_clip: float | None = 1.0  # the clip ``trainer.grad_clip: auto`` gives it

    def sampler_logps(self, o: ObjectiveConfig, trust_region: float | None) -> bool:
        """Whether searchers must record the sampling policy's per-token log-probs: the ratio
        objectives, Proximal RLOO or RLOO with ``tis_cap``, and trajectory balance with a band
        (``trust_region``), the second-moment filter or the ESS learning rate."""
        if self.ratio:
            return True
        if self.balance:
            return trust_region is not None or o.tb_m2_threshold is not None or bool(o.tb_ess_lr)
        return o.type == "rloo" and (o.rloo_proximal or o.tis_cap is not None)

    def moves_reference(self, o: ObjectiveConfig) -> bool:
        """TBA′: the reference follows the policy every ``objective.ref_reset_every`` steps."""
        return self.balance and bool(o.ref_reset_every)


NEEDS: dict[str, Needs] = dict(  # by objective.type
    tb=Needs(ratio=False, balance=True, grad_clip=None),
    grpo=Needs(ratio=True),
    dr_grpo=Needs(ratio=True),
    ppo=Needs(ratio=True),
    rloo=Needs(ratio=False),
    online_dpo=Needs(ratio=False, pairs_only=True),
)


def needs(objective: ObjectiveConfig | str) -> Needs:
    """The needs of ``objective`` (its config, or its ``type``)."""
    name = objective if isinstance(objective, str) else objective.type
    return NEEDS[name]
