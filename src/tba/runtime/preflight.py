"""Checks before anything heavy loads, cheapest first: the task and its tokenizer (the dataset
loads, prompts fit, reward functions score two rows), then the models (built-in ones built on first
use; found and causal LMs, from their configs alone). ``tba train`` runs them before the run
directory exists; the builders (:mod:`tba.runtime.build`) and ``tba eval`` too."""

from __future__ import annotations

from pathlib import Path

from tba.config import Config, ConfigError
from tba.demo import BUILTIN_PREFIX, TOOL_MODEL
from tba.demo.builtin import build_builtin
from tba.generation.multi_turn import make_conversations
from tba.generation.vllm_backend import check_vllm_backend
from tba.models.loading import check_causal_lm, eos_ids, generation_config_of, load_tokenizer
from tba.models.lora import check_lora_config
from tba.models.tiny import build_char_tokenizer, build_tool_tokenizer
from tba.plan import Plan, builtin_setting
from tba.runtime.policy import quiet_transformers
from tba.tasks import Task, build_task


def check_models(cfg: Config, plan: Plan, log=print) -> None:
    """Build the built-in models the plan names, where it names them, on first use, and check, from
    their configs alone, that the policy and the reference exist and are causal LMs: before the run
    directory exists."""
    for name, path in ((cfg.model.policy, plan.policy), (cfg.model.reference, plan.reference)):
        warm = builtin_setting(name, cfg) if name else None
        if warm is not None:
            build_builtin(name, warm, Path(path), log)
    config = check_causal_lm(plan.policy, cfg.model.trust_remote_code, what="model.policy")
    if plan.reference != plan.policy:
        check_causal_lm(plan.reference, cfg.model.trust_remote_code, what="model.reference")
    if cfg.generation.backend == "vllm":
        check_vllm_backend(config, plan.torch_device, sleep=cfg.generation.vllm.sleep)


def make_task(cfg: Config, tokenizer=None, log=print) -> Task:
    return build_task(cfg.task, tokenizer=tokenizer, chat_template=cfg.model.chat_template, log=log)


def prepare_task(cfg: Config, log=print) -> tuple[Task, object]:
    """The task and the tokenizer, checked before any model is loaded (or, for the demo model,
    built): the dataset loads, its prompts fit, and the reward functions score two evaluation
    rows; ``model.lora`` settings fit LoRA's reference. Raises with a message that says what to fix."""
    quiet_transformers()
    check_lora_config(cfg)
    m = cfg.model
    if m.tokenizer is None and m.policy.startswith(BUILTIN_PREFIX):  # its tokenizer, without building the model
        tokenizer = build_tool_tokenizer() if m.policy == TOOL_MODEL else build_char_tokenizer()
    else:
        what = "model.tokenizer" if m.tokenizer else "model.policy"
        tokenizer = load_tokenizer(m.tokenizer or m.policy, m.trust_remote_code, what=what)
    task = make_task(cfg, tokenizer, log)
    task.check()
    if cfg.task.multi_turn:  # the tools load and the template can call them, before any model is loaded
        make_conversations(cfg.task, tokenizer, eos_ids(tokenizer, None, m.eos_tokens, m.chat_template)).close()
    if cfg.eval.samples > 1 and not task.success_scores:
        raise ConfigError(
            f"eval.samples={cfg.eval.samples} asks for pass@k, which needs a success score: "
            "set task.success_threshold (a reward at or above it is a success)"
        )
    log(task.describe())
    return task, tokenizer


def policy_tokenizer(cfg: Config, plan: Plan, prepared_tokenizer):
    """The policy's tokenizer: a built-in model's folder has its own (``model.tokenizer`` unset), else
    the one :func:`prepare_task` loaded."""
    m = cfg.model
    if m.tokenizer is None and m.policy.startswith(BUILTIN_PREFIX):
        return load_tokenizer(plan.policy, m.trust_remote_code)
    return prepared_tokenizer


def ready_plan(cfg: Config, plan: Plan, prepared_tokenizer, log=print) -> Plan:
    """``plan`` (:func:`tba.plan.make_plan`'s for ``cfg``) ready for the builders: its models built
    (a built-in one on first use) and checked, and the ids that end a completion.
    ``prepared_tokenizer``: the tokenizer :func:`prepare_task` returned. What ``tba train`` does
    before it builds anything; a library user builds components from this plan."""
    check_models(cfg, plan, log)
    return plan_with_eos(cfg, plan, policy_tokenizer(cfg, plan, prepared_tokenizer))


def plan_with_eos(cfg: Config, plan: Plan, tokenizer) -> Plan:
    """``plan`` with the ids that end a completion, found before the policy's weights load (from its
    generation config), so that searcher processes can start while the trainer loads them."""
    m = cfg.model
    config = generation_config_of(plan.policy, m.trust_remote_code)
    return plan.with_eos(eos_ids(tokenizer, None, m.eos_tokens, m.chat_template, generation_config=config))
