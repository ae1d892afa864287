"""The trainer's optimizer: AdamW over the trainable parameters, and its learning-rate schedule
(:func:`tba.schedules.lr_multiplier`)."""

from __future__ import annotations

import torch

from tba.config import TrainerConfig
from tba.schedules import lr_multiplier


def make_optimizer(
    model: torch.nn.Module, cfg: TrainerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``model``'s trainable parameters, and its learning-rate schedule, both fresh."""
    params = [p for p in model.parameters() if p.requires_grad]
    # one kernel for the whole update on a GPU (plain tensors: sharded ones take torch's default)
    fused = all(p.is_cuda and type(p) is torch.nn.Parameter for p in params) and bool(params)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True if fused else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s,
            cfg.steps,
            cfg.warmup_steps,
            cfg.lr_schedule,
            cfg.min_lr_ratio,
            cfg.lr_stable_steps,
            cfg.lr_decay_steps,
        ),
    )
    return optimizer, scheduler
