"""The generation interface that searchers and the evaluator are written against.

A backend turns prompt token ids into completions; it can also take new policy weights. The HF
``generate`` backend (:mod:`tba.generation.hf`) and the vLLM backend
(:mod:`tba.generation.vllm_backend`) implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # EOS is masked until a completion has this many tokens
    greedy: bool = False
    logprobs: bool = False  # also return each completion token's log-prob under the sampling policy
    # HF: take them from the logits the sampling pass computed (no second pass; within the precision's
    # rounding of the trainer's pass: enough for TB's band) rather than a teacher-forced pass with the
    # trainer's own code (ratios start at exactly 1, as the ratio objectives' clip assumes)
    sampled_logprobs: bool = False


@dataclass
class Completion:
    """What a backend generated for one sample; a multi-turn conversation
    (:class:`tba.generation.turns.Trajectory`) fills the fields after ``token_logps`` too."""

    token_ids: list[int]  # up to and including the first EOS
    finished: bool  # ended with EOS (else cut at max_new_tokens)
    token_logps: list[float] | None = None  # with SamplingParams.logprobs: log π(token) at temperature 1
    # per token, 1 where the policy wrote it and 0 where an environment added it; None: all the policy's
    action_mask: list[int] | None = None
    reward: float | None = None  # an environment's own reward; None: the task's reward functions score it
    failed: bool = False  # its environment raised: not usable (dropped, counted)


class Generator(Protocol):
    version: int
    """The trainer step of the weights it holds (-1 before the first :meth:`load_weights`): what its
    completions are tagged with."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the sampling policy's weights with ``state_dict`` (trainer step ``version``)."""
        ...
