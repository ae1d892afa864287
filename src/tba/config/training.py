"""The ``objective``, ``buffer`` and ``trainer`` sections: what the trainer optimises, on what, and how."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tba.config.section import Section


class ObjectiveConfig(Section):
    type: Literal["tb", "grpo", "dr_grpo", "ppo", "rloo", "online_dpo"] = "tb"
    """Training objective: ``tb`` (trajectory balance, VarGrad log Z), or a baseline: ``grpo``,
    ``dr_grpo``, ``ppo`` (clipped, group baseline, no value network), ``rloo``, ``online_dpo``."""
    beta: float = Field(0.05, gt=0)
    """KL coefficient β (start value when annealed); the DPO temperature for ``online_dpo``."""
    beta_final: float | None = Field(None, gt=0)
    """If set, β moves linearly from ``beta`` to this over ``beta_anneal_steps``, then stays."""
    beta_anneal_steps: int = Field(0, ge=0)
    """Steps of the linear β annealing."""
    beta_final_from: int | None = Field(None, ge=0)
    """From this step on β is ``beta_final`` even if the annealing has not reached it (TL;DR: step 32)."""
    scale_beta_sq: bool = False
    """``tb``: multiply the loss by β² so annealing β does not change the effective step size."""
    ref_reset_every: int | None = Field(None, ge=1)
    """``tb``: every ρ trainer steps the reference becomes the current policy (the paper's TBA′)."""
    tb_trust_region: float | Literal["auto"] | None = "auto"
    """``tb`` on stale data: drop a completion's term when its gradient would push the policy further
    than τ from its sampler in log-ratio (PPO's clip on the TB residual); None: plain TB. ``auto``:
    0.5 for ``tb`` where the data is stale by design (the ray runtime, or ``runtime.extra_lag`` > 0),
    plain TB otherwise. Two steps of staleness cost plain TB most of its gain on small batches; this
    band gives it back (docs: Runtimes, "What staleness costs trajectory balance"). It needs the
    sampler's token log-probs: HF generation takes them from its own sampling pass, vLLM returns them."""
    tb_trust_region_sequence: bool = True
    """``tb_trust_region`` on the sequence log-ratio (summed over tokens, as proximal RLOO clips it);
    false: on its per-token mean, a band on a sequence's probability that widens with its length."""
    tb_m2_threshold: float | None = Field(None, gt=0)
    """``tb`` on stale data: drop the completions whose mean squared token log-ratio to the sampler is
    largest, until the batch's mean of it is at most this (M2PO's rule, per sequence). Typical: 0.04."""
    tb_huber: float | None = Field(None, gt=0)
    """``tb``: Huber form of the squared residual, linear beyond |residual| = κ (bounds each
    completion's pull on the policy)."""
    tb_ess_lr: bool = False
    """``tb`` on stale data: each step's learning rate times the effective sample size (a fraction) of
    the batch's sequence importance weights π/π_sampler (VCPO's idea): 1 on-policy, small when stale."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """Ratio clipping ε of ``grpo``, ``dr_grpo``, ``ppo`` and proximal ``rloo``."""
    kl_coef: float = Field(0.0, ge=0)
    """``grpo``: weight of the KL penalty to the reference (0: none, as in Dr. GRPO)."""
    rloo_proximal: bool = False
    """``rloo``: clip the sequence ratio against the sampler (Proximal RLOO, for off-policy data)."""
    max_tokens: int | None = Field(None, ge=1)
    """``dr_grpo``: the constant that token sums are divided by; default generation.max_new_tokens."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling for the ratio objectives (``grpo``, ``dr_grpo``, ``ppo``,
    ``rloo``), as verl and TRL correct vLLM samplers: the ratio is taken against the trainer's own
    log-probs at the step's start and each token's term is weighted by min(π_trainer/π_sampler, cap)
    (a sequence weight for ``rloo``). None (default): the ratio is to the sampler's log-probs, clipped.
    Typical cap: 2."""

    @model_validator(mode="after")
    def _check_anneal(self) -> ObjectiveConfig:
        if self.beta_final is not None and self.beta_anneal_steps <= 0 and self.beta_final_from is None:
            raise ValueError(
                "beta_final needs beta_anneal_steps > 0 (or beta_final_from): set one of them, or unset beta_final"
            )
        variants = [
            f"objective.{key}"
            for key in ("tb_trust_region", "tb_m2_threshold", "tb_huber")
            if getattr(self, key) not in (None, "auto")
        ] + (["objective.tb_ess_lr"] if self.tb_ess_lr else [])
        if variants and self.type != "tb":
            raise ValueError(f"{', '.join(variants)} change(s) trajectory balance: set objective.type=tb or unset it")
        if self.tis_cap is not None and self.type in ("tb", "online_dpo"):
            raise ValueError(
                f"objective.tis_cap weights the ratio objectives (grpo, dr_grpo, ppo, rloo) by π_trainer/π_sampler; "
                f"{self.type} uses no sampler log-probs (it learns from any sampler's data as it is): unset tis_cap"
            )
        return self

    @field_validator("tb_trust_region")
    @classmethod
    def _positive_band(cls, value):
        if isinstance(value, float | int) and not value > 0:
            raise ValueError(f"tb_trust_region must be positive, None (plain TB) or 'auto', got {value}")
        return value


class BufferConfig(Section):
    capacity: int = Field(100_000, ge=1)
    """Rollouts held in the replay buffer; the oldest are evicted first."""
    per_prompt_capacity: int | None = Field(100, ge=1)
    """Rollouts held per prompt (the paper's per-prompt buffer); None for no limit."""
    recent_prob: float = Field(0.95, ge=0, le=1)
    """m: probability of drawing a prompt that got data since the last weight publication."""
    reward_inv_temp: float = 0.0
    """Otherwise completions are drawn by softmax(reward * inv_temp); 0 is uniform."""
    min_completions: int = Field(2, ge=1)
    """Distinct completions a prompt needs before it can be drawn."""
    flat_weight: float | Literal["auto"] = "auto"
    """Weight of a recent prompt whose newest group has no reward contrast (all rewards equal)
    against 1 for one with contrast; 0: flat groups only when no other recent prompt is left, 1:
    uniform. ``auto``: 0 in the ray runtime, where searchers deliver more recent prompts than a batch
    takes and this lets asynchronous TB learn as much per step as sync on sparse rewards
    (benchmarks/results/real_model/README.md); 1 in sync, whose recent window is the step's
    own batch. Costs the pull toward the reference that flat groups carry."""
    min_groups: int | None = None
    """Groups to collect before the first step; default: one batch (trainer.batch_prompts)."""
    fill_patience: int | None = Field(32, ge=1)
    """How long the initial fill may go on with nothing to train on: after this many generation
    batches' worth of prompts (``generation.prompts_per_batch`` each) drawn since the buffer last
    gained a prompt it can sample, the run stops and says what the searchers delivered (empty,
    unfinished or unscored completions, groups dropped, duplicates); it says so once already after 4.
    None: wait as long as it takes."""
    fresh_only: bool = False
    """On-policy training without replay (``runtime.type=sync``): each step trains on exactly the
    groups generated for it (``generation.prompts_per_batch`` = ``trainer.batch_prompts``), every
    completion as sampled, duplicates included; the buffer is not used. With
    ``trainer.sync_interval=1`` and ``runtime.extra_lag=0`` every rollout is 0 steps old. A step
    whose groups were all dropped (empty completions, failed rewards) is skipped and counted
    (``train/empty_steps``)."""

    @field_validator("flat_weight")
    @classmethod
    def _flat_weight_in_range(cls, value):
        if value != "auto" and not 0.0 <= value <= 1.0:  # NaN fails too
            raise ValueError(f"flat_weight is a relative weight in [0, 1] or 'auto', got {value}")
        return value


class TrainerConfig(Section):
    steps: int = Field(600, ge=1)
    """Optimizer steps."""
    batch_prompts: int = Field(16, ge=1)
    """Prompts (groups) per batch; each contributes generation.group_size completions."""
    micro_batch_prompts: int | None = None
    """Groups per forward/backward pass (gradient accumulation); default: the whole batch."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget of one forward/backward pass: micro-batches are filled with whole groups (the
    per-prompt log Z needs all K completions) while the positions their pass computes stay within
    it, padding included: sequences × (longest prompt + longest completion) when padded, rows ×
    their width when packed (``packing``), so packed passes hold more real tokens in the same
    budget. A group larger than the budget runs alone. Groups are ordered by length first. Combines
    with ``micro_batch_prompts`` (both limits hold). The step equals one pass over the whole batch:
    each micro-batch's loss is weighted by its share of it."""
    packing: bool = True
    """Packed (padding-free) forward and backward passes: a micro-batch's sequences are concatenated
    into rows with ``position_ids`` restarting at each, and attention stays within each sequence, so
    nothing is computed on padding (``train/padding_fraction``). A model that cannot be packed (an
    attention that reads no restarts, logits that are not a plain head's: checked at start) is
    padded, with one warning. false: pad every pass (to the longest sequence of its micro-batch)."""
    packing_row_tokens: int | Literal["auto"] = "auto"
    """Positions of one packed row. ``auto``: one row a pass with flash attention or flex attention
    (their cost stays within sequences); with ``sdpa`` and ``eager``, whose dense mask computes every
    position of a row against every other, rows as wide as the pass's longest sequence, so a packed
    pass never computes more positions or attention scores than the padded one."""
    reference_packing: bool = True
    """Pack the searchers' reference log-prob passes and evaluation's scoring passes too (as
    ``packing``; the reference model falls back to padding by the same check)."""
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = "auto"
    """Numerics of the trainer. ``bf16-mixed``: fp32 master weights and AdamW state, forward and
    backward in bfloat16 (autocast), log-probs in fp32. ``fp32``: fp32 throughout. ``bf16``: bfloat16
    weights and optimizer state with no master copy, so updates below ~1/256 of a weight are lost
    (warned at start). ``auto``: bf16-mixed on GPUs with bfloat16, else fp32. Searchers, the reference
    and evaluation keep ``model.dtype``; published weights are cast to it."""
    num_ranks: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Trainer processes that the policy is sharded over (FSDP2 per decoder layer, one GPU each on GPUs,
    gloo on CPUs): weights, gradients and AdamW state take 1/N of the memory each. Each step's groups
    are split over them, whole groups; the step equals the 1-rank step on the whole batch. 1: the
    trainer runs in the ``tba train`` process itself. Ranks run as Ray actors (both runtimes) on one node.
    ``auto``: 1 on a CPU machine or a single GPU; on several GPUs the ray runtime's split of them
    (``runtime.num_searchers``), with the trainer's memory as a constraint. A resumed run keeps the
    count it started with (it is in its saved config): the count decides how sums round."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' activation checkpointing): much less activation memory for one more forward
    pass of the layers per step."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warmup over this many steps (from lr/(warmup_steps+1) up to lr)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """After warmup: constant, or cosine / linear decay to ``min_lr_ratio`` at the last step."""
    lr_stable_steps: int = Field(0, ge=0)
    """Steps at the peak learning rate after warmup, before the decay starts."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Length of the decay; default: until the last step (a longer one is cut where training ends)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the decayed learning rate, as a fraction of ``lr``."""
    grad_clip: float | Literal["auto"] | None = "auto"
    """Clip the global gradient norm to this; None disables clipping. ``auto``: no clipping for
    ``tb``, 1.0 for the other objectives. TB's gradient is about 1/β times larger than the others'
    and varies a hundredfold between a batch with reward signal and one without (where it only
    pulls toward the reference); a clip of 1.0 binds on every TB step and gives both the same
    size, which on a real model keeps asynchronous TB from learning (benchmarks/results/real_model/README.md).
    Adam bounds each weight's step either way."""

    @field_validator("packing_row_tokens")
    @classmethod
    def _positive_row(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError(f"packing_row_tokens must be a positive number of positions or 'auto', got {value}")
        return value

    @field_validator("grad_clip")
    @classmethod
    def _positive_clip(cls, value):
        if isinstance(value, float | int) and not value > 0:
            raise ValueError(f"grad_clip must be positive, None (no clipping) or 'auto', got {value}")
        return value

    sync_interval: int = Field(1, ge=1)
    """k: publish weights to searchers every k steps."""
    max_replay_ratio: float | None = Field(1.0, gt=0)
    """``ray`` runtime: at most this many trained samples per sample the searchers delivered, over
    the last ``replay_window`` steps; a step that would exceed it waits for new groups (counted in
    ``trainer/wait_s``). None: the trainer never waits once the buffer can fill a batch."""
    replay_window: int | None = Field(None, ge=1)
    """Steps over which ``max_replay_ratio`` holds (the run's start counts the initial fill). None:
    the plan's, 16 or twice the steps' worth of data one batch of every searcher brings, whichever
    is larger: searchers that start together deliver together, and a window shorter than their
    burst forgets the surplus (the trainer then waits with data in hand)."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (always at the end)."""
    keep_checkpoints: int | None = Field(3, ge=1)
    """Once a newer checkpoint is complete, delete older ``checkpoints/step_*`` beyond the newest N
    (the newest, and so the run's final one, always stays); None keeps them all."""
    save_merged: bool = False
    """With ``model.lora``: checkpoints also hold the merged full model in ``merged/``, which
    ``AutoModelForCausalLM.from_pretrained`` loads without PEFT."""
