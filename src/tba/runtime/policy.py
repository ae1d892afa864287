"""The trainer's copy of the policy (its precision, LoRA adapter, activation
checkpointing), seeding, and transformers kept quiet. The builders (:mod:`tba.runtime.build`) and
the trainer ranks (:mod:`tba.runtime.ranks`) both load from here."""

from __future__ import annotations

import random

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from tba.config import ConfigError, GenerationConfig, ModelConfig, ObjectiveConfig, TrainerConfig
from tba.models.loading import (
    load_causal_lm,
)
from tba.models.logprobs import unwrap
from tba.models.lora import (
    add_adapter,
)
from tba.models.precision import Precision
from tba.plan import Plan
from tba.trainer import Trainer
from tba.weights import NoSender


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_transformers() -> None:
    hf_logging.disable_progress_bar()  # per-file loading bars would bury the run's own progress


def load_trainer_policy(
    m: ModelConfig,
    t: TrainerConfig,
    path: str,
    device: torch.device,
    precision: Precision,
    gradient_checkpointing: bool = True,
) -> torch.nn.Module:
    """The policy the trainer updates (``model``, loaded from ``path``), in ``precision``'s weights
    dtype (fp32 master weights for bf16-mixed). With LoRA only the adapter trains: the frozen base
    stays in ``model.dtype`` unless the precision is fp32, and PEFT keeps the adapter in fp32 (cast
    to bf16 for pure bf16). ``trainer.gradient_checkpointing`` applies where ``gradient_checkpointing``."""
    dtype = precision.weights_dtype_name()
    if m.lora is not None and precision.mode == "bf16-mixed":
        dtype = m.dtype
    policy = load_causal_lm(path, device, dtype, m.trust_remote_code)
    if m.lora is not None:
        policy = add_adapter(policy, m.lora)  # only the adapter trains; the base is the reference
        if precision.mode == "bf16":
            policy = policy.to(torch.bfloat16)
    if t.gradient_checkpointing and gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (it needs no
    input that requires grad, so it works under a LoRA adapter). A model without it is a config error."""
    base = unwrap(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"trainer.gradient_checkpointing=true, but {type(base).__name__} does not support activation "
            "checkpointing in transformers; set it to false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_trainer(
    t: TrainerConfig,
    o: ObjectiveConfig,
    g: GenerationConfig,
    plan: Plan,
    model: torch.nn.Module,
    pad_id: int,
    eos: set[int],
    precision: Precision,
    **parts,
) -> Trainer:
    """A trainer of ``model`` with the run's ``trainer`` and ``objective`` settings (of
    ``generation``: the group size and the completions' longest length) and the run plan's
    decisions for them (TB's band, the gradient clip); ``parts``: the buffer, weight store, ranks
    and publication dtype of the process that holds it (none for a rank)."""
    parts = {
        "buffer": None,
        "weights": NoSender(),
        "trust_region": plan.trust_region,
        "grad_clip": plan.grad_clip,
        "sampler_logps": plan.sampler_logprobs != "none",
        **parts,
    }
    return Trainer(
        model,
        parts.pop("buffer"),
        parts.pop("weights"),
        t,
        o,
        g.group_size,
        pad_id,
        eos,
        max_new_tokens=g.max_new_tokens,
        precision=precision,
        **parts,
    )
