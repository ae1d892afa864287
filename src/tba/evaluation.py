"""Evaluation of a policy on a task's held-out split, the same for every task.

- Greedy: one completion per problem; ``eval/<metric>`` is the mean task score (accuracy for
  arithmetic and GSM8K, reward for a dataset task), ``eval/completion_len`` the mean length in
  tokens.
- Sampled (``eval.samples = n > 1``): n completions per problem at the sampling temperature;
  ``eval/pass@k`` is the unbiased estimator of Chen et al. (2021) from n samples, ``eval/maj@k``
  the expected correctness of a majority vote over k of them (answers from ``task.answer_key``).
  Both need a task whose scores are successes.
- A few problems with their greedy completions and scores are returned for ``samples.jsonl``.

A task with an evaluation of its own (win rate under a judge, attack success and diversity)
overrides ``Task.evaluate`` and gets the same generator, tokenizer and settings.

:class:`Evaluator` is what every caller uses, so that an evaluation is the same code wherever it
runs: periodically during training (in the trainer process, or in an evaluation actor with
``eval.async=true``) and in ``tba eval`` on a run, a checkpoint or a model. It holds what an
evaluation needs besides the weights: the task (its own models, such as a judge or a victim, set
up on first use), the tokenizer, a generator over the policy, the completion end tokens, and the
frozen reference for tasks that measure KL (asked for only when the task needs it).
:func:`tba.runtime.build.load_evaluator` builds one from a config alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tba.config import EvalConfig, GenerationConfig
from tba.eval_metrics import sampled_metrics
from tba.generation.base import Generator, SamplingParams
from tba.generation.hf import HFGenerator
from tba.generation.turns import ConversationSource, reply_texts, with_conversation
from tba.models.loading import encode_prompts
from tba.rewards import RewardStats
from tba.tasks.base import EvalContext, Task
from tba.types import EvalResult, EvalSettings


def evaluate(
    task: Task,
    generator: Generator,
    tokenizer,
    settings: EvalSettings,
    eos_ids: set[int] | None = None,
    reference=None,
    conversations: ConversationSource | None = None,
) -> EvalResult:
    """The task's own evaluation if it has one (``Task.evaluate``), else the generic one; with
    ``conversations`` (tools or an environment), each problem is a whole conversation, scored by its
    environment's reward or, without one, by the task on the last reply."""
    eos = eos_ids or {tokenizer.eos_token_id}
    chat_template = settings.chat_template  # (the prompts' encoding)
    ctx = EvalContext(generator, tokenizer, settings, chat_template, eos, reference)
    custom = task.evaluate(ctx)
    if custom is not None:
        return custom
    prompts = task.eval_prompts()[: settings.limit]
    stats = RewardStats()
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=settings.max_new_tokens)
    ids, outs = _generate(generator, tokenizer, prompts, greedy, chat_template, conversations)
    outs = [o[0] for o in outs]
    texts = reply_texts(tokenizer, outs, eos)
    scores = _scores(task, prompts, texts, outs, stats)
    scored = [s for s in scores if s is not None]
    metrics = {
        f"eval/{task.eval_metric}": sum(scored) / len(scored) if scored else float("nan"),
        "eval/completion_len": sum(len(o.token_ids) for o in outs) / len(outs),
        "eval/problems": float(len(prompts)),
    }
    if len(scored) < len(scores):
        metrics["eval/unscored"] = float(len(scores) - len(scored))
    metrics.update(_per_group(task, prompts, scores))
    if conversations is not None:
        metrics["eval/turns"] = sum(o.turns for o in outs) / len(outs)
    answers: list[dict] = []
    if settings.samples > 1:
        found, answers = _sampled(task, generator, tokenizer, prompts, ids, eos, settings, stats, conversations)
        metrics.update(found)
    samples = [
        {"id": p.id, "prompt": p.text, "completion": t, "score": s, "answer": p.answer}
        for p, t, s in list(zip(prompts, texts, scores, strict=True))[: settings.log_samples]
    ]
    if conversations is not None:  # the whole conversation, with the tools' answers
        for sample, o in zip(samples, outs, strict=False):
            sample["conversation"] = o.messages
    return EvalResult(metrics, samples, answers)


def _per_group(task: Task, prompts, scores) -> dict[str, float]:
    """Each part's mean score (:meth:`Task.eval_group`), where the task has parts."""
    parts: dict[str, list[float]] = {}
    for p, s in zip(prompts, scores, strict=True):
        group = task.eval_group(p)
        if group is not None and s is not None:
            parts.setdefault(group, []).append(s)
    return {f"eval/{task.eval_metric}/{group}": sum(v) / len(v) for group, v in sorted(parts.items())}


def _generate(generator, tokenizer, prompts, params, chat_template, conversations):
    """The prompts' token ids and their completions (whole conversations with ``conversations``)."""
    if conversations is not None:
        return conversations.rollout(generator, prompts, params)
    ids = encode_prompts(tokenizer, prompts, chat_template)
    return ids, generator.generate(ids, params)


def _scores(task: Task, prompts, texts, outs, stats) -> list[float | None]:
    """The task's score of each completion; a conversation's environment reward where it gave one
    (a conversation whose environment raised: None, unscored)."""
    prompts = [with_conversation(p, o) for p, o in zip(prompts, outs, strict=True)]
    scores = task.scores(prompts, texts, [o.token_ids for o in outs], stats)
    for i, o in enumerate(outs):
        if getattr(o, "failed", False):
            scores[i] = None
        elif getattr(o, "reward", None) is not None and o.finished:
            scores[i] = o.reward
    return scores


def _sampled(
    task: Task, generator, tokenizer, prompts, ids, eos, settings: EvalSettings, stats, conversations=None
) -> tuple[dict[str, float], list[dict]]:
    """The sampled metrics, and each problem's sampled answers (``task.answer_key``) with their
    verdicts, for ``eval_answers.jsonl``."""
    if not task.success_scores:
        raise ValueError(
            f"eval.samples={settings.samples} needs a task whose scores are successes; "
            "for a dataset task set task.success_threshold"
        )
    n = settings.samples
    params = SamplingParams(
        n=n, temperature=settings.temperature, top_p=settings.top_p, max_new_tokens=settings.max_new_tokens
    )
    if conversations is not None:
        _, groups = conversations.rollout(generator, prompts, params)
    else:
        groups = generator.generate(ids, params)
    outs = [c for group in groups for c in group]  # [problems * n], per problem consecutive
    texts = reply_texts(tokenizer, outs, eos)
    flat_prompts = [p for p in prompts for _ in range(n)]
    scores = _scores(task, flat_prompts, texts, outs, stats)
    problems, answers = [], []
    for i, prompt in enumerate(prompts):
        part = slice(i * n, (i + 1) * n)
        keys = [task.answer_key(t) for t in texts[part]]
        wins = [1.0 if s is not None and task.is_success(s) else 0.0 for s in scores[part]]
        problems.append((keys, wins))
        answers.append({"id": prompt.id, "answers": keys, "wins": wins})
    found = sampled_metrics(problems, list(settings.pass_k))
    out = {f"eval/{name}": value for name, value in found.items() if name != "mean_score"}
    out["eval/sampled_success"] = found["mean_score"]
    return out, answers


def eval_settings(
    e: EvalConfig, g: GenerationConfig, reference_packing: bool, chat_template: bool | None
) -> EvalSettings:
    """How evaluation generates, from the ``eval`` and ``generation`` sections (``eval.max_new_tokens``
    unset: the completions' budget), ``trainer.reference_packing`` and ``model.chat_template``."""
    return EvalSettings(
        max_new_tokens=e.max_new_tokens or g.max_new_tokens,
        limit=e.limit,
        samples=e.samples,
        pass_k=tuple(e.pass_k),
        temperature=g.temperature,
        top_p=g.top_p,
        log_samples=e.log_samples,
        packing=reference_packing,
        batch_size=e.batch_size,
        chat_template=chat_template,
    )


class Evaluator:
    """Evaluates ``policy`` (whatever weights it holds when called) on ``task``."""

    def __init__(
        self,
        settings: EvalSettings,
        task: Task,
        tokenizer,
        policy: torch.nn.Module,
        eos_ids: set[int],
        reference: Callable[[], torch.nn.Module | None] = lambda: None,
        generator: Generator | None = None,
        conversations: ConversationSource | None = None,
    ):
        """``generator``: a backend that holds its own copy of the policy (a vLLM engine), which
        :meth:`load_weights` then updates too; default: HF ``generate`` on ``policy``.
        ``conversations``: the task's tools or environment (:func:`tba.conversations.make_conversations`),
        closed with the evaluator."""
        self.settings = settings
        self.task = task
        self.tokenizer = tokenizer
        self.policy = policy
        self.eos_ids = eos_ids
        self.generator = generator or HFGenerator(
            policy, tokenizer.pad_token_id, eos_ids, batch_size=settings.batch_size
        )
        self.separate_copy = generator is not None  # the generator holds its own copy of the policy
        self.conversations = conversations
        self._reference = reference
        self._task_ready = False

    def __call__(self) -> EvalResult:
        if not self._task_ready:  # task-owned models (a reward model, a victim) on first use
            self.task.setup(next(self.policy.parameters()).device)
            self._task_ready = True
        reference = self._reference() if getattr(self.task, "needs_reference", False) else None
        return evaluate(
            self.task,
            self.generator,
            self.tokenizer,
            self.settings,
            self.eos_ids,
            reference,
            self.conversations,
        )

    def close(self) -> None:
        """Stop the conversations' threads and, for an agent task, its endpoint."""
        if self.conversations is not None:
            self.conversations.close()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load what the trainer publishes (the full state dict, or a LoRA policy's adapter)."""
        from tba.models.lora import load_published_state

        load_published_state(self.policy, state)
        if self.separate_copy:
            self.generator.load_weights(state, version=-1)


def write_samples(run_dir: Path, step: int, samples: list[dict], answers: list[dict] = ()) -> None:
    """Append an evaluation's completions, with their scores, to ``<run>/samples.jsonl``, and with
    ``eval.samples`` > 1 each problem's sampled answers and verdicts (one line a problem:
    ``{"step", "id", "answers", "wins"}``) to ``<run>/eval_answers.jsonl``."""
    for name, records in (("samples.jsonl", samples), ("eval_answers.jsonl", answers)):
        if records:
            with (Path(run_dir) / name).open("a") as f:
                for record in records:
                    f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
