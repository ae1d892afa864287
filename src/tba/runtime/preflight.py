"""Checks before anything heavy loads, cheapest first: the task and its tokenizer (the dataset
loads, prompts fit, reward functions score two rows), then the models (built-in ones built on first
use; found and causal LMs, from their configs alone). ``tba train`` runs them before the run
directory exists; the builders (:mod:`tba.runtime.build`) and ``tba eval`` too."""

from __future__ import annotations

import random
from pathlib import Path

from tba.config import ConfigError, GenerationConfig, ModelConfig, ObjectiveConfig
from tba.conversations import make_conversations
from tba.demo import BUILTIN_PREFIX, TOOL_MODEL
from tba.demo.builtin import build_builtin
from tba.generation.vllm_backend import check_vllm_backend
from tba.models.loading import check_causal_lm, encode_prompts, eos_ids, generation_config_of, load_tokenizer
from tba.models.lora import check_lora_config
from tba.models.tiny import build_char_tokenizer, build_tool_tokenizer
from tba.plan import Plan, builtin_setting
from tba.runtime.policy import quiet_transformers
from tba.tasks import Task, build_task


def check_models(m: ModelConfig, g: GenerationConfig, task_cfg, plan: Plan, log=print):
    """Build the built-in models the plan names (``model``; a built-in one is warm-started on the
    setting of ``task_cfg``, the task's config), where it names them, on first use, and check, from
    their configs alone, that the policy and the reference exist and are causal LMs, and that the
    ``generation`` backend can serve the policy: before the run directory exists. Returns the
    policy's config (None for a PEFT adapter folder)."""
    for name, path in ((m.policy, plan.policy), (m.reference, plan.reference)):
        warm = builtin_setting(name, task_cfg) if name else None
        if warm is not None:
            build_builtin(name, warm, Path(path), log)
    config = check_causal_lm(plan.policy, m.trust_remote_code, what="model.policy")
    if plan.reference != plan.policy:
        check_causal_lm(plan.reference, m.trust_remote_code, what="model.reference")
    if g.backend == "vllm":
        check_vllm_backend(config, plan.torch_device, sleep=g.vllm.sleep)
    return config


def context_length(config) -> int | None:
    """The positions a model's config allows (``max_position_embeddings``, GPT-2's ``n_positions``),
    or None where it names none."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(
    m: ModelConfig, g: GenerationConfig, task_cfg, task: Task, tokenizer, config, sample: int = 256
) -> None:
    """Refuse a run whose prompts leave no room for their completions in the policy's context: the
    longest of ``sample`` evaluation prompts and ``sample`` training prompts (drawn without moving the
    task's place), plus ``generation.max_new_tokens``, against the positions the model's config
    allows. Such a model writes nothing usable (HF generation past the context gives empty or
    garbled completions, vLLM refuses the request), and the run would fill its buffer forever."""
    limit, new = context_length(config), g.max_new_tokens
    bound = getattr(task_cfg, "max_prompt_tokens", None)  # the task drops longer prompts
    if limit is None or (bound is not None and bound + new <= limit):
        return
    state = task.sampler_state()
    try:
        drawn = task.sample_prompts(sample, random.Random(0))
    finally:
        task.load_sampler_state(state)
    prompts = drawn + task.eval_prompts()[:sample]
    longest = max((len(ids) for ids in encode_prompts(tokenizer, prompts, m.chat_template)), default=0)
    if longest + new > limit:
        room = limit - new
        fix = (
            f"set task.max_prompt_tokens={room} to drop the longer prompts, or lower generation.max_new_tokens"
            if room > 0
            else f"lower generation.max_new_tokens below {limit}"
        )
        raise ConfigError(
            f"prompts of up to {longest} tokens plus generation.max_new_tokens={new} need {longest + new} "
            f"positions, and the policy's context is {limit} ({m.policy}): {fix}, or use a model "
            "with a longer context"
        )


def make_task(task_cfg, chat_template: bool | None, tokenizer=None, log=print) -> Task:
    """The task of ``task_cfg`` (``task``), its prompts encoded as the policy's ``chat_template`` says."""
    return build_task(task_cfg, tokenizer=tokenizer, chat_template=chat_template, log=log)


def prepare_task(m: ModelConfig, task_cfg, o: ObjectiveConfig, eval_samples: int = 1, log=print) -> tuple[Task, object]:
    """The task of ``task_cfg`` (the task's config) and the tokenizer of ``model``, checked before any
    model is loaded (or, for the demo model, built): the dataset loads, its prompts fit, and the
    reward functions score two evaluation rows; ``model.lora`` settings fit the objective's
    reference; ``eval_samples`` (``eval.samples``) above 1 has a success score to count. Raises with
    a message that says what to fix."""
    quiet_transformers()
    check_lora_config(m, o)
    if m.tokenizer is None and m.policy.startswith(BUILTIN_PREFIX):  # its tokenizer, without building the model
        tokenizer = build_tool_tokenizer() if m.policy == TOOL_MODEL else build_char_tokenizer()
    else:
        what = "model.tokenizer" if m.tokenizer else "model.policy"
        tokenizer = load_tokenizer(m.tokenizer or m.policy, m.trust_remote_code, what=what)
    task = make_task(task_cfg, m.chat_template, tokenizer, log)
    task.check()
    if task_cfg.multi_turn:  # the tools load and the template can call them, before any model is loaded
        make_conversations(task_cfg, tokenizer, eos_ids(tokenizer, None, m.eos_tokens, m.chat_template)).close()
    if eval_samples > 1 and not task.success_scores:
        raise ConfigError(
            f"eval.samples={eval_samples} asks for pass@k, which needs a success score: "
            "set task.success_threshold (a reward at or above it is a success)"
        )
    log(task.describe())
    return task, tokenizer


def policy_tokenizer(m: ModelConfig, plan: Plan, prepared_tokenizer):
    """The policy's tokenizer: a built-in model's folder has its own (``model.tokenizer`` unset), else
    the one :func:`prepare_task` loaded."""
    if m.tokenizer is None and m.policy.startswith(BUILTIN_PREFIX):
        return load_tokenizer(plan.policy, m.trust_remote_code)
    return prepared_tokenizer


def ready_plan(
    m: ModelConfig,
    g: GenerationConfig,
    task_cfg,
    plan: Plan,
    prepared_tokenizer,
    log=print,
    task: Task | None = None,
) -> Plan:
    """``plan`` (:func:`tba.plan.make_plan`'s for the run's config, whose ``model``, ``generation``
    and ``task`` sections these are) ready for the builders: its models built (a built-in one on
    first use) and checked (:func:`check_models`), and the ids that end a completion.
    ``prepared_tokenizer``: the tokenizer :func:`prepare_task` returned. What ``tba train`` does
    before it builds anything; a library user builds components from this plan. Given the prepared
    ``task``, its prompts are checked against the policy's context too (:func:`check_context`)."""
    config = check_models(m, g, task_cfg, plan, log)
    tokenizer = policy_tokenizer(m, plan, prepared_tokenizer)
    if task is not None:
        check_context(m, g, task_cfg, task, tokenizer, config)
    return plan_with_eos(m, plan, tokenizer)


def plan_with_eos(m: ModelConfig, plan: Plan, tokenizer) -> Plan:
    """``plan`` with the ids that end a completion, found before the policy's weights load (from its
    generation config), so that searcher processes can start while the trainer loads them."""
    config = generation_config_of(plan.policy, m.trust_remote_code)
    return plan.with_eos(eos_ids(tokenizer, None, m.eos_tokens, m.chat_template, generation_config=config))
