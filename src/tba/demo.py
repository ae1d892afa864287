"""The built-in demo model (``model.policy: builtin:tiny-arithmetic``): the tiny Llama of
:mod:`tba.models.tiny`, warm-started on arithmetic so that reinforcement learning starts from
partial accuracy.

``ensure_tiny_model(task_cfg)`` returns a local directory holding an ordinary Hugging Face
checkpoint (``config.json``, ``model.safetensors``, tokenizer files) that ``from_pretrained``
loads like any other. The package ships the default settings' models (:data:`SHIPPED_DIR`, built
by ``python -m tba.demo``, i.e. ``make demo-models``) and checks their weights against the sha256
recorded beside them on every load, so every machine starts the demo from the same weights. Other
settings are built once and cached under ``$TBA_CACHE`` (default ``~/.cache/tba``).

The warm start is supervised next-token training on ``problem=answer<eos>`` strings from the
task's training split, stopped as soon as greedy accuracy on a validation sample of that split,
averaged over the last ``smooth_checks`` checks, reaches ``target_accuracy`` (so the RL demo has
room to improve, whatever the machine's speed). Single checks jump by 10 points between steps;
stopping at the first one over the target made each CPU's float rounding pick another spike and
another model, whose RL gain differed by 10-15 points. The smoothed criterion makes a rebuild land
in the same regime; only the shipped weights make it the same model (another CPU's rounding still
sends 800 steps of SGD along another path).
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
from tba.tasks import build_task
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


TOOL_MODEL = "builtin:tiny-tools"
TOOL_SPEC = TinySpec(max_positions=96, lr=3e-4, check_every=2, target_accuracy=0.3, validation_size=128, version=2)
TOOL_TRAJECTORY_TOKENS = 48  # the tool demo's task.max_trajectory_tokens: a call, its answer, the final answer
"""The tool demo model: the demo's shape over :func:`build_tool_tokenizer`, warm-started on
calculator traces until it solves 30% of validation problems with the tool (the mean of the last
three checks, two steps apart: accuracy jumps from about 10% to 45% within four steps once the
model starts calling the tool)."""
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


def ensure_tiny_tool_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = TOOL_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """Path of the warm-started tool demo checkpoint (``builtin:tiny-tools``) for this arithmetic
    setting: the shipped one (checked by hash), else built on first use and cached."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"{TOOL_MODEL} is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec, kind="tiny-tools")
    task = ArithmeticTask(task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms)
    found = shipped(path.name) if use_shipped else None
    return found or _cached(path, "tool demo model", spec, build_tool_tokenizer, warm_start_tools, task, log)


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


def ensure_tiny_model(
    task_cfg, cache_dir: str | None = None, spec: TinySpec = DEFAULT_SPEC, log=print, use_shipped: bool = True
) -> Path:
    """Path of the warm-started demo checkpoint for this arithmetic setting: the shipped one (checked
    by hash) for the settings the package ships, else built on first use and cached."""
    if task_cfg.name != "arithmetic":
        raise ValueError(f"builtin:tiny-arithmetic is warm-started on the arithmetic task, not {task_cfg.name!r}")
    path = tiny_model_path(task_cfg, cache_dir, spec)
    task = ArithmeticTask(
        task_cfg.digits, task_cfg.operators, task_cfg.eval_size, task_cfg.seed, task_cfg.terms, task_cfg.show_work
    )
    found = shipped(path.name) if use_shipped else None
    return found or _cached(path, "demo model", spec, build_char_tokenizer, warm_start, task, log)


SHIPPED_DIR = Path(__file__).resolve().parent / "demo_models"
"""The warm-started models the package ships, one folder each, named as in the cache."""
SHIPPED_INDEX = SHIPPED_DIR / "shipped.json"
"""For each shipped folder: the sha256 of its ``model.safetensors``, the greedy accuracy it evaluates
at on its task's held-out problems, and the machine that built it."""


def shipped_index() -> dict:
    return json.loads(SHIPPED_INDEX.read_text()) if SHIPPED_INDEX.is_file() else {}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped(name: str) -> Path | None:
    """The shipped model folder called ``name`` (``tiny-arithmetic-<setting hash>``) after checking
    its weights against their recorded hash; None if the package ships none of that name."""
    entry = shipped_index().get(name)
    if entry is None:
        return None
    path = SHIPPED_DIR / name
    weights = path / "model.safetensors"
    if not weights.is_file() or file_sha256(weights) != entry["sha256"]:
        raise RuntimeError(
            f"the shipped demo model {path} is missing or damaged (its weights do not match the sha256 "
            f"{entry['sha256'][:12]}... recorded in {SHIPPED_INDEX.name}); reinstall tba, or rebuild the shipped "
            "models with `make demo-models`"
        )
    return path


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


SHIPPED_SETTINGS = {"tiny-arithmetic": {}, "tiny-tools": {"digits": 3, "operators": "*"}}
"""The arithmetic settings whose models the package ships: the demo's (``tba train``,
``configs/custom_task.yaml``) and the tool demo's (``configs/tools.yaml``)."""


def shipped_accuracy(kind: str, path: Path, task_cfg) -> float:
    """Greedy accuracy of a demo model on its setting's held-out problems, as a run's first evaluation
    measures it (``eval/accuracy`` at step 0, the default ``generation.max_new_tokens``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = build_task(task_cfg)
    with torch.no_grad():
        if kind == "tiny-tools":
            return tool_accuracy(model, tokenizer, task, task.eval_prompts(), TOOLS)
        return greedy_accuracy(model, tokenizer, task, task.eval_prompts())


def build_shipped(out: Path = SHIPPED_DIR, cache_dir: str | None = None, log=print) -> dict:
    """Warm-start the shipped models afresh (or take them from ``cache_dir``, a cache that holds
    builds of this code) and write them to ``out`` with their index (``shipped.json``)."""
    from tba.config import ArithmeticTaskConfig
    from tba.machine import describe_machine

    out.mkdir(parents=True, exist_ok=True)
    cache = cache_dir or tempfile.mkdtemp(prefix="tba-demo-models-")
    index = {}
    for kind, setting in SHIPPED_SETTINGS.items():
        task_cfg = ArithmeticTaskConfig(**setting)
        ensure = ensure_tiny_tool_model if kind == "tiny-tools" else ensure_tiny_model
        built = ensure(task_cfg, cache, log=log, use_shipped=False)
        target = out / built.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(built, target)
        index[built.name] = {
            "sha256": file_sha256(target / "model.safetensors"),
            "eval_accuracy": shipped_accuracy(kind, target, task_cfg),
            "warm_start": json.loads((target / "warm_start.json").read_text()),
            "built_on": describe_machine(),
        }
        log(f"{kind}: {target.name}, greedy accuracy {index[built.name]['eval_accuracy']:.1%} on held-out problems")
    for stale in out.iterdir():  # the folders of settings or recipes no longer shipped
        if stale.is_dir() and stale.name not in index:
            shutil.rmtree(stale)
    (out / SHIPPED_INDEX.name).write_text(json.dumps(index, indent=2) + "\n")
    return index


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tba.demo",
        description="Rebuild the demo models the package ships (src/tba/demo_models) and their hashes.",
    )
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="where to write them (default: the package's)")
    parser.add_argument("--cache-dir", help="a model cache whose builds of this code to take instead of rebuilding")
    args = parser.parse_args(argv)
    build_shipped(args.out, args.cache_dir)


if __name__ == "__main__":
    main()
