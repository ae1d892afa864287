"""Gradients of one trainer step, and the batches and sequences they are taken on."""

from __future__ import annotations

import random

from tests.helpers.numerics import assert_reordered_close

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.trainer import Trainer
from tba.types import Batch, Rollout
from tba.weights import LocalWeightStore

VOCAB = 32_000  # a real vocabulary size (Llama 2's), on a model a few MB large


def random_sequences(n: int, seed: int = 1, vocab: int = VOCAB) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 2-12 tokens and completions of 1-20, ids across the whole vocabulary."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    completions = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return prompts, completions


def assert_grads_close(a: dict, b: dict, terms: int) -> None:
    """Each parameter's gradient equal up to reordering sums of ``terms`` fp32 terms, relative to
    that gradient's largest entry."""
    assert_reordered_close(a, b, terms=terms)


def uneven_batch(tokenizer, n_groups: int = 6, k: int = 4, seed: int = 0) -> Batch:
    """Groups of very different lengths: prompts of 2-20 tokens, completions of 1-40."""
    rng = random.Random(seed)
    prompt_ids, rollouts = [], []
    for g in range(n_groups):
        prompt_ids.append([1] + [rng.randrange(3, 14) for _ in range(rng.choice([1, 4, 19]))])
        longest = rng.choice([1, 8, 40])
        for j in range(k):
            completion = tuple(rng.randrange(3, 14) for _ in range(rng.randint(max(1, longest // 3), longest)))
            rollouts.append(Rollout(f"p{g}", completion, float(rng.random() < 0.5), -5.0 - j, 0, 0))
    return Batch(prompt_ids, rollouts, k)


def step_gradients(tiny_model, tokenizer, batch: Batch, objective: str, **trainer_cfg):
    """The gradients the optimizer sees in one trainer step, and the step's metrics."""
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    model.train()
    cfg = TrainerConfig(batch_prompts=batch.num_groups, lr=1e-3, warmup_steps=0, grad_clip=None, **trainer_cfg)
    trainer = Trainer(
        model,
        ReplayBuffer(),
        LocalWeightStore(),
        cfg,
        ObjectiveConfig(type=objective, beta=0.5, tb_trust_region=None),  # the band has its own tests
        batch.group_size,
        tokenizer.pad_token_id,
        {tokenizer.eos_token_id},
    )
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    metrics = trainer.step(batch)
    return seen[0], metrics
