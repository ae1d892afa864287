"""The warm start of the demo models: supervised next-token training on the task's training
problems (the tool model: on calculator traces), stopped once smoothed greedy accuracy on a
validation sample reaches the target (see :mod:`tba.demo`)."""

from __future__ import annotations

import random
import time

import torch

from tba.environments import ToolEnvironment, environment_text
from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.generation.turns import Conversations
from tba.models.builtin import DEFAULT_SPEC, TOOL_SPEC, TinySpec
from tba.models.logprobs import pack
from tba.models.tiny import CALL_CLOSE, CALL_OPEN
from tba.tasks.arithmetic import ArithmeticTask
from tba.tasks.calculator import calculator
from tba.tools import load_tools, tool_call_format

TOOLS = ["tba.tasks.calculator:calculator"]
"""The tool demo's tools."""
TOOL_TRAJECTORY_TOKENS = 48  # the tool demo's task.max_trajectory_tokens: a call, its answer, the final answer


def greedy_accuracy(model, tokenizer, task: ArithmeticTask, prompts, max_new_tokens: int = 8) -> float:
    gen = HFGenerator(model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    outs = gen.generate(ids, SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
    texts = tokenizer.batch_decode([o[0].token_ids for o in outs], skip_special_tokens=True)
    return sum(task.reward(p, t) for p, t in zip(prompts, texts, strict=True)) / len(prompts)


def supervised_step(model, opt, prompts, targets, pad_id: int, masks=None) -> torch.Tensor:
    """One optimizer step of next-token cross-entropy on ``targets`` after ``prompts`` (token ids);
    with ``masks``, on the target tokens marked 1 only. Returns the loss."""
    ids, attn, comp_mask, p_len = pack(prompts, targets, pad_id)
    for i, mask in enumerate(masks or []):
        comp_mask[i, : len(mask)] *= torch.tensor(mask)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, p_len - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, p_len:], reduction="none")
    loss = (nll * comp_mask).sum() / comp_mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def warm_start(model, tokenizer, task: ArithmeticTask, spec: TinySpec = DEFAULT_SPEC, log=print) -> dict:
    """Supervised training on correct answers until validation accuracy reaches the target."""
    rng = random.Random(spec.seed)
    valid = task.sample_prompts(spec.validation_size, random.Random(spec.seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    checks, step, start = [], 0, time.time()
    model.train()
    for step in range(1, spec.max_steps + 1):
        batch = task.sample_prompts(spec.batch_size, rng)
        prompts = [tokenizer(p.text)["input_ids"] for p in batch]
        targets = [tokenizer(task.target(p), add_special_tokens=False)["input_ids"] + [eos] for p in batch]
        loss = supervised_step(model, opt, prompts, targets, tokenizer.pad_token_id)
        if step % spec.check_every == 0:
            checks.append(greedy_accuracy(model, tokenizer, task, valid, task.max_answer_tokens + 1))
            log(f"warm start step {step}: loss {loss.item():.3f}, validation accuracy {checks[-1]:.1%}")
            if reached(checks, spec):
                break
    return warm_start_info(step, checks, spec, start)


def reached(checks: list[float], spec: TinySpec) -> bool:
    """Whether the mean of the last ``spec.smooth_checks`` validation accuracies reaches the target:
    one lucky check is not enough to stop on."""
    last = checks[-spec.smooth_checks :]
    return len(last) == spec.smooth_checks and sum(last) / len(last) >= spec.target_accuracy


def warm_start_info(step: int, checks: list[float], spec: TinySpec, start: float) -> dict:
    last = checks[-spec.smooth_checks :] or [0.0]
    return {
        "steps": step,
        "validation_accuracy": checks[-1] if checks else 0.0,
        "validation_accuracy_smoothed": sum(last) / len(last),
        "seconds": round(time.time() - start, 1),
    }


def tool_trace(tokenizer, prompt, tools) -> tuple[list[int], list[int], list[int]]:
    """A worked tool-use conversation for an arithmetic prompt (``123*456=``): the prompt's ids, then
    the model's call of the calculator, the tool's answer, and the model's final answer (the
    answer's tokens), with the mask of the model's tokens (1) and the tool's (0)."""
    eos = tokenizer.eos_token_id
    opening = [{"role": "user", "content": prompt.text}]
    prompt_ids = tokenizer.apply_chat_template(opening, tools=tools, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids if isinstance(prompt_ids, list) else prompt_ids["input_ids"])
    expression = prompt.text.rstrip("=")
    call = f"<tool_call>{CALL_OPEN}{expression}{CALL_CLOSE}</tool_call>"
    first = tokenizer.encode(call, add_special_tokens=False) + [eos]
    answer = {"role": "tool", "name": "calculator", "content": calculator(expression)}
    between = environment_text([*opening, {"role": "assistant", "content": call}], [answer], tokenizer, "<eos>", tools)
    env = tokenizer.encode(between, add_special_tokens=False)
    final = tokenizer.encode(prompt.answer, add_special_tokens=False) + [eos]
    return prompt_ids, first + env + final, [1] * len(first) + [0] * len(env) + [1] * len(final)


def tool_accuracy(model, tokenizer, task: ArithmeticTask, prompts, tools: list | None) -> float:
    """Greedy accuracy of whole conversations with the calculator (``tools``; None: without it, the
    model's first reply is its answer)."""
    eos = {tokenizer.eos_token_id}
    gen = HFGenerator(model, tokenizer.pad_token_id, eos)
    params = SamplingParams(n=1, greedy=True, max_new_tokens=16)
    if tools is None:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], tokenize=True) for p in prompts]
        ids = [list(i if isinstance(i, list) else i["input_ids"]) for i in ids]
        outs = [o[0] for o in gen.generate(ids, params)]
        content = [[t for t in o.token_ids if t not in eos] for o in outs]
        texts = tokenizer.batch_decode(content, skip_special_tokens=True)
        return sum(task.reward(p, t) for p, t in zip(prompts, texts, strict=True)) / len(prompts)
    fmt = tool_call_format(tokenizer)
    loaded = load_tools(tools)
    turns = Conversations(
        tokenizer, lambda: ToolEnvironment(loaded, fmt), eos, 3, TOOL_TRAJECTORY_TOKENS, loaded, workers=1
    )
    try:
        _, trajectories = turns.rollout(gen, prompts, params)
    finally:
        turns.close()
    wins = [t[0].finished and task.reward(p, t[0].text) for p, t in zip(prompts, trajectories, strict=True)]
    return sum(wins) / len(prompts)


def warm_start_tools(model, tokenizer, task: ArithmeticTask, spec: TinySpec = TOOL_SPEC, log=print) -> dict:
    """Supervised training on calculator traces (the model's tokens only) until greedy accuracy with
    the calculator reaches the target on a validation sample."""
    tools = load_tools(TOOLS)
    rng = random.Random(spec.seed)
    valid = task.sample_prompts(spec.validation_size, random.Random(spec.seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    checks, step, start = [], 0, time.time()
    for step in range(1, spec.max_steps + 1):
        model.train()
        traces = [tool_trace(tokenizer, p, tools) for p in task.sample_prompts(spec.batch_size, rng)]
        prompts, targets, masks = (list(column) for column in zip(*traces, strict=True))
        loss = supervised_step(model, opt, prompts, targets, tokenizer.pad_token_id, masks)
        if step % spec.check_every == 0:
            model.eval()
            checks.append(tool_accuracy(model, tokenizer, task, valid, TOOLS))
            acc = checks[-1]
            log(f"warm start step {step}: loss {loss.item():.3f}, validation accuracy with the calculator {acc:.1%}")
            if reached(checks, spec):
                break
    model.eval()
    return warm_start_info(step, checks, spec, start)
