"""The trainer sharded over ranks, built as a run builds it, after a few steps on synthetic groups."""

from __future__ import annotations

from tests.conftest import SMALL_DEMO_ARGS
from tests.helpers.trainers import synthetic_groups

from tba.config import load_config


def train_on_ranks(cache, ranks: int, extra: list[str], steps: int = 2):
    """The demo's components with ``trainer.num_ranks=ranks`` (and ``extra`` settings), their trainer
    after ``steps`` steps on one batch of synthetic groups, and each step's metrics."""
    from tests.conftest import components

    from tba.runtime.policy import seed_everything

    cfg = load_config(
        None,
        [
            *SMALL_DEMO_ARGS,
            "--run.device=cpu",
            f"--model.cache_dir={cache}",
            "--trainer.batch_prompts=6",
            "--trainer.warmup_steps=0",
            "--trainer.lr=1e-3",
            "--runtime.rank_cpus=0.5",
            f"--trainer.num_ranks={ranks}",
            "--objective.tb_trust_region=null",  # synthetic groups carry no sampler log-probs
            *extra,
        ],
    )
    seed_everything(cfg.run.seed)  # as a run does: the same LoRA initialisation for 1 and 2 ranks
    c = components(cfg, log=lambda m: None, with_searcher=False)
    c.trainer.ingest(synthetic_groups(c.tokenizer, n_prompts=6, k=cfg.generation.group_size))
    if not steps:  # the buffer not drawn from yet: the caller's first draw is the batch steps would take
        return c, []
    batch = c.buffer.sample(6, cfg.generation.group_size)
    return c, [c.trainer.step(batch) for _ in range(steps)]
