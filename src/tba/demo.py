"""The built-in demo model (``model.policy: builtin:tiny-arithmetic``): the tiny Llama of
:mod:`tba.models.tiny`, warm-started on arithmetic so that reinforcement learning starts from
partial accuracy.

``ensure_tiny_model(task_cfg)`` returns a local directory holding an ordinary Hugging Face
checkpoint (``config.json``, ``model.safetensors``, tokenizer files) that ``from_pretrained``
loads like any other. It is built once per task setting and cached under ``$TBA_CACHE`` (default
``~/.cache/tba``); later runs reuse it.

The warm start is supervised next-token training on ``problem=answer<eos>`` strings from the
task's training split, stopped as soon as greedy accuracy on a validation sample of that split
reaches ``target_accuracy`` (so the RL demo has room to improve, whatever the machine's speed).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tba.environments import ToolEnvironment, environment_text
from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.generation.turns import Conversations
from tba.models.logprobs import pack
from tba.models.tiny import (
    CALL_CLOSE,
    CALL_OPEN,
    DEFAULT_SPEC,
    TinySpec,
    build_char_tokenizer,
    build_tiny_llama,
    build_tool_tokenizer,
)
from tba.tasks.arithmetic import ArithmeticTask
from tba.tasks.calculator import calculator
from tba.tools import load_tools, tool_call_format

MULTI_TURN_SETTINGS = (
    "tools",
    "environment",
    "environment_args",
    "max_turns",
    "max_trajectory_tokens",
    "tool_timeout",
    "system_prompt",
    "environment_workers",
)

BUILTIN_PREFIX = "builtin:"


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
    acc, step, start = 0.0, 0, time.time()
    model.train()
    for step in range(1, spec.max_steps + 1):
        batch = task.sample_prompts(spec.batch_size, rng)
        prompts = [tokenizer(p.text)["input_ids"] for p in batch]
        targets = [tokenizer(task.target(p), add_special_tokens=False)["input_ids"] + [eos] for p in batch]
        loss = supervised_step(model, opt, prompts, targets, tokenizer.pad_token_id)
        if step % spec.check_every == 0:
            acc = greedy_accuracy(model, tokenizer, task, valid, task.max_answer_tokens + 1)
            log(f"warm start step {step}: loss {loss.item():.3f}, validation accuracy {acc:.1%}")
            if acc >= spec.target_accuracy:
                break
    return {"steps": step, "validation_accuracy": acc, "seconds": round(time.time() - start, 1)}


TOOL_MODEL = "builtin:tiny-tools"
TOOL_SPEC = TinySpec(max_positions=96, lr=3e-4, check_every=5, target_accuracy=0.3, validation_size=128, version=1)
TOOL_TRAJECTORY_TOKENS = 48  # the tool demo's task.max_trajectory_tokens: a call, its answer, the final answer
"""The tool demo model: the demo's shape over :func:`build_tool_tokenizer`, warm-started on
calculator traces until it solves 30% of validation problems with the tool."""
TOOLS = ["tba.tasks.calculator:calculator"]


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
    acc, step, start = 0.0, 0, time.time()
    for step in range(1, spec.max_steps + 1):
        model.train()
        traces = [tool_trace(tokenizer, p, tools) for p in task.sample_prompts(spec.batch_size, rng)]
        prompts, targets, masks = (list(column) for column in zip(*traces, strict=True))
        loss = supervised_step(model, opt, prompts, targets, tokenizer.pad_token_id, masks)
        if step % spec.check_every == 0:
            model.eval()
            acc = tool_accuracy(model, tokenizer, task, valid, TOOLS)
            log(f"warm start step {step}: loss {loss.item():.3f}, validation accuracy with the calculator {acc:.1%}")
            if acc >= spec.target_accuracy:
                break
    model.eval()
    return {"steps": step, "validation_accuracy": acc, "seconds": round(time.time() - start, 1)}


def ensure_tiny_tool_model(task_cfg, cache_dir: str | None = None, spec: TinySpec = TOOL_SPEC, log=print) -> Path:
    """Path of the warm-started tool demo checkpoint (``builtin:tiny-tools``) for this arithmetic
    setting; built on first use."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"{TOOL_MODEL} is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec, kind="tiny-tools")
    task = ArithmeticTask(task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms)
    return _cached(path, "tool demo model", spec, build_tool_tokenizer, warm_start_tools, task, log)


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("TBA_CACHE") or Path.home() / ".cache" / "tba")


def tiny_model_path(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, kind: str = "tiny-arithmetic"
) -> Path:
    """Where the demo checkpoint of this arithmetic setting is cached: named by a hash of the setting."""
    setting = task_cfg.model_dump()
    for name in ("reward_timeout", *MULTI_TURN_SETTINGS):  # how rollouts are run, not what the model learns
        setting.pop(name, None)
    for name, default in (("terms", 2), ("show_work", False)):  # settings added later: keep the old caches' keys
        if setting.get(name) == default:
            setting.pop(name, None)
    key = {"task": setting, "spec": asdict(spec)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"{kind}-{digest}"


def ensure_tiny_model(task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, log=print) -> Path:
    """Path of the warm-started demo checkpoint for this arithmetic setting; built on first use."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"builtin:tiny-arithmetic is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec)
    task = ArithmeticTask(
        task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms, task_cfg.show_work
    )
    return _cached(path, "demo model", spec, build_char_tokenizer, warm_start, task, log)


def _cached(path: Path, what: str, spec: TinySpec, make_tokenizer, warm, task, log) -> Path:
    """``path`` if it holds a finished build; else a tiny Llama over ``make_tokenizer()``, warm-started
    by ``warm(model, tokenizer, task, spec, log)`` and saved there."""
    if (path / "warm_start.json").is_file():
        return path
    log(f"building the {what} (once; cached at {path})")
    torch.manual_seed(spec.seed)
    tokenizer = make_tokenizer()
    model = build_tiny_llama(tokenizer, spec)
    info = warm(model, tokenizer, task, spec, log)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(info, indent=2))
    if path.exists():  # a half-written directory from an interrupted build
        shutil.rmtree(path)
    os.replace(tmp, path)  # atomic: a crash never leaves a cache entry that looks complete
    log(f"demo model ready: {info['parameters']:,} parameters, {info['steps']} warm-start steps")
    return path
