"""A run's parts in one process (:class:`Components`: what :func:`tba.runtime.build.build_components`
returns) and the evaluator of the trainer's policy among them, built on first use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tba.buffer import ReplayBuffer
from tba.config import GenerationConfig, ModelConfig, TrainerConfig
from tba.evaluation import Evaluator
from tba.models.loading import load_causal_lm
from tba.models.lora import ReferenceView
from tba.plan import Plan
from tba.runtime.ledger import PromptLedger
from tba.searcher import Searcher
from tba.tasks import Task
from tba.trainer import Trainer
from tba.types import EvalSettings


@dataclass(frozen=True)
class SearcherSections:
    """The config sections a searcher is built from (:func:`tba.runtime.build.make_searcher`): the
    rest of what it needs is the plan's."""

    generation: GenerationConfig
    trainer: TrainerConfig  # the reference pass is cut as the trainer's passes are
    model: ModelConfig
    task: object  # the task's config (``task``)
    seed: int  # ``run.seed``


@dataclass
class Components:
    task: Task
    tokenizer: object
    policy: torch.nn.Module
    buffer: ReplayBuffer
    trainer: Trainer
    searcher: Searcher | None
    eos_ids: set[int]
    plan: Plan  # with the EOS ids
    task_name: str = "task"  # task.name
    evaluation: EvalSettings | None = None  # how the policy is evaluated (eval, generation)
    new_evaluator: Callable[[], Evaluator] | None = None  # the policy's evaluator (:func:`policy_evaluator`)
    evaluator: Evaluator | None = None  # of the policy, built on first evaluation
    ledger: PromptLedger = field(default_factory=PromptLedger)  # every prompt the searchers drew

    @property
    def policy_path(self) -> str:
        return self.plan.policy

    def close(self) -> None:
        """Stop what runs outside this process or thread for these parts (the trainer's ranks, its
        weights' sender, an agent task's endpoints), each even if another fails."""
        try:
            self.trainer.weights.close()
        finally:
            try:
                self.trainer.updates.close()
            finally:
                for part in (self.searcher, self.evaluator):
                    if part is not None:
                        part.close()


def policy_evaluator(c: Components) -> Evaluator:
    """The evaluator of the trainer's own policy, built on first use (:func:`trainer_evaluator`)."""
    if c.evaluator is None:
        c.evaluator = c.new_evaluator()
    return c.evaluator


def trainer_evaluator(c: Components, conversations, m: ModelConfig, backend: str) -> Evaluator:
    """The evaluator of the trainer's policy in ``c``. With vLLM searchers in the sync runtime it
    generates on the searcher's engine (loaded with the trainer's weights for each evaluation, the
    searcher's own reloaded after); otherwise with HF ``generate`` on the policy (the ray runtime's
    trainer holds no engine: ``eval.async=true`` evaluates on the evaluation actor's). The frozen
    reference, for evaluations that need it (KL): the searcher's in the sync runtime; in the ray
    runtime, where the trainer holds none, built once on first use. It evaluates as
    ``c.evaluation`` says."""
    if c.searcher is not None:
        searcher = c.searcher
        reference = lambda: searcher.reference  # noqa: E731
    else:
        reference = lazy_reference(m, c.plan, c.policy)
    engine = None
    if c.searcher is not None and backend == "vllm":
        engine = c.searcher.generator
        engine = getattr(engine, "inner", engine)  # past random exploration: evaluation samples as configured
    return Evaluator(c.evaluation, c.task, c.tokenizer, c.policy, c.eos_ids, reference, engine, conversations)


def lazy_reference(m: ModelConfig, plan: Plan, policy: torch.nn.Module):
    """The frozen reference for an evaluation that needs it (KL), as a function that builds it on
    its first call and then returns the same one: a LoRA policy's base model (the adapter switched
    off), else ``model.reference`` (or ``model.policy``) loaded beside ``policy``."""
    held: list[torch.nn.Module] = []

    def reference() -> torch.nn.Module:
        if not held:
            if m.lora is not None:
                held.append(ReferenceView(policy))
            else:
                device = next(policy.parameters()).device
                held.append(load_causal_lm(plan.reference, device, plan.dtype, m.trust_remote_code, trainable=False))
        return held[0]

    return reference
