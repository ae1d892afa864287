"""Trainers on tiny models, and the synthetic groups and batches they train on."""

from __future__ import annotations

import random

import torch
from tests.helpers.numerics import model_terms

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.models.logprobs import token_logprobs
from tba.plan.auto import grad_clip, tb_trust_region
from tba.trainer import Trainer
from tba.types import Batch, Rollout, RolloutGroup
from tba.weights import LocalWeightStore


def make_trainer(model, tokenizer, buffer, weights, beta=0.5, **overrides):
    cfg = TrainerConfig(**{"batch_prompts": 4, "lr": 1e-3, "warmup_steps": 0, "sync_interval": 2, **overrides})
    return Trainer(
        model,
        buffer,
        weights,
        cfg,
        ObjectiveConfig(beta=beta, tb_trust_region=None),  # synthetic groups carry no sampler log-probs
        4,
        tokenizer.pad_token_id,
        {tokenizer.eos_token_id},
    )


def synthetic_groups(tokenizer, n_prompts=6, k=4, version=0, seed=0):
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    groups = []
    for i in range(n_prompts):
        prompt = tokenizer(f"{i}+{i}=")["input_ids"]
        comps = [tokenizer(str(rng.randint(0, 99)), add_special_tokens=False)["input_ids"] + [eos] for _ in range(k)]
        comps = [c + [j] for j, c in enumerate(comps)] if len({tuple(c) for c in comps}) < k else comps
        groups.append(
            RolloutGroup(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                completions=comps,
                rewards=[float(rng.random() < 0.5) for _ in range(k)],
                ref_logps=[-5.0 - j for j in range(k)],
                policy_version=version,
            )
        )
    return groups


def batch_and_trainer(tokenizer, objective: ObjectiveConfig, shift: float):
    """A trainer on a tiny model and a batch of 2 groups x 4 whose sampler log-probs are the
    trainer's own (exact, teacher forcing) plus ``shift`` per token."""
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    torch.manual_seed(0)
    policy = build_tiny_llama(tokenizer, SMALL).train()
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("4+4=")["input_ids"]]
    completions = [[tokenizer.convert_tokens_to_ids(c) for c in s] + [eos] for s in ("3", "12", "8", "7", "5", "44")]
    completions = [completions[i % 6] for i in range(8)]
    flat_prompts = [prompts[i // 4] for i in range(8)]
    with torch.no_grad():
        token_logp, mask = token_logprobs(policy, flat_prompts, completions, tokenizer.pad_token_id, {eos})
    rollouts = [
        Rollout(
            prompt_id=str(i // 4),
            completion=tuple(c),
            reward=float(i % 3 == 0),
            ref_logp=-3.0,
            policy_version=0,
            arrival_step=0,
            sampler_token_logps=tuple((token_logp[i, : len(c)] + shift).tolist()),
        )
        for i, c in enumerate(completions)
    ]
    batch = Batch(prompts, rollouts, 4)
    cfg = TrainerConfig(batch_prompts=2, lr=1e-3, warmup_steps=0, sync_interval=1)
    # the band and the clip as the ray runtime's plan resolves them (data stale by design)
    band, clip = tb_trust_region(objective, stale=True), grad_clip(cfg, objective.type)
    trainer = Trainer(
        policy,
        ReplayBuffer(capacity=100),
        LocalWeightStore(),
        cfg,
        objective,
        4,
        0,
        {eos},
        4,
        trust_region=band,
        grad_clip=clip,
    )
    return trainer, batch


def reorder_terms(trainer: Trainer) -> int:
    """The batch_and_trainer batch: 8 rows of at most 5 + 3 positions."""
    return model_terms(trainer.model.config, 8 * 8)
