"""Greedy evaluation of a policy on a task's held-out split."""

from __future__ import annotations

from tba.generation.base import Generator, SamplingParams
from tba.models.loading import encode_prompts
from tba.tasks.base import Task


def evaluate(
    task: Task,
    generator: Generator,
    tokenizer,
    max_new_tokens: int,
    chat_template: bool | None = None,
    eos_ids: set[int] | None = None,
) -> dict[str, float]:
    """``eval/<metric>`` (mean score of greedy completions) and ``eval/completion_len``."""
    prompts = task.eval_prompts()
    ids = encode_prompts(tokenizer, [p.text for p in prompts], chat_template)
    outs = generator.generate(ids, SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
    eos = eos_ids or {tokenizer.eos_token_id}
    scores, lengths = [], []
    for prompt, (out,) in zip(prompts, outs, strict=True):
        text = tokenizer.decode([t for t in out.token_ids if t not in eos], skip_special_tokens=True)
        scores.append(task.score(prompt, text))
        lengths.append(len(out.token_ids))
    return {
        f"eval/{task.eval_metric}": sum(scores) / len(scores),
        "eval/completion_len": sum(lengths) / len(lengths),
    }
