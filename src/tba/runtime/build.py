"""Build a run's parts from its config: task, tokenizer, models, generator, searcher, trainer (with
its ranks when ``trainer.num_ranks`` > 1), buffer and evaluator. Every runtime and ``tba eval``
build through here, so the sync and ray runtimes train the same thing."""

from __future__ import annotations

from pathlib import Path

import torch

from tba.buffer import ReplayBuffer
from tba.checkpoint import load_policy_weights
from tba.config import BufferConfig, Config, GenerationConfig, ModelConfig
from tba.conversations import make_conversations
from tba.evaluation import Evaluator, eval_settings
from tba.generation.base import Generator, SamplingParams
from tba.generation.explore import ExploringGenerator
from tba.generation.hf import HFGenerator
from tba.generation.stream import open_stream
from tba.generation.vllm_backend import AdapterLoraGenerator, LoraEngine, MergedLoraGenerator, VLLMGenerator
from tba.models.loading import load_causal_lm, load_tokenizer
from tba.models.lora import (
    ReferenceView,
    add_adapter,
    copy_sharing_frozen,
    policy_state,
    published_state,
)
from tba.models.precision import Precision
from tba.plan import Plan
from tba.runtime.components import Components, SearcherSections, lazy_reference, trainer_evaluator
from tba.runtime.policy import load_trainer_policy, make_trainer, quiet_transformers
from tba.runtime.preflight import make_task, policy_tokenizer, prepare_task
from tba.runtime.ranks import RankGroup
from tba.searcher import Searcher, StreamingSearcher
from tba.tasks import Task
from tba.weights import DelayedWeights, LocalWeightStore, Receiver, Sender, publications_to_keep


def make_buffer(b: BufferConfig, seed: int, plan: Plan) -> ReplayBuffer:
    """The replay buffer of ``buffer`` settings, drawing with ``seed`` (``run.seed``)."""
    return ReplayBuffer(
        capacity=b.capacity,
        per_prompt_capacity=b.per_prompt_capacity,
        recent_prob=b.recent_prob,
        reward_inv_temp=b.reward_inv_temp,
        min_completions=b.min_completions,
        seed=seed,
        flat_weight=plan.flat_weight,
    )


def completion_eos(plan: Plan) -> set[int]:
    """The token ids that end a completion, as the plan names them (:func:`tba.runtime.preflight.ready_plan`)."""
    if not plan.eos_ids:
        raise ValueError(
            "the plan names no end-of-completion ids: build from tba.runtime.preflight.ready_plan (or plan_with_eos)"
        )
    return set(plan.eos_ids)


def make_generator(
    g: GenerationConfig,
    m: ModelConfig,
    plan: Plan,
    sampler: torch.nn.Module | None,
    pad_id: int,
    eos: set[int],
    seed: int,
    role: str = "searcher",
) -> Generator:
    """The searcher's generation backend (``generation``): HF ``generate`` over ``sampler``, or a
    vLLM engine that loads ``model.policy`` itself (``sampler`` is then None, or for a LoRA policy
    the PEFT copy whose merged weights the engine is handed at each publication). ``seed``: the
    engine's; ``role``: whose engine (``searcher``, ``evaluation``): its memory and sleep are the
    plan's for that role."""
    if g.backend == "hf":
        return HFGenerator(sampler, pad_id, eos)

    settings = g.vllm
    engine = VLLMGenerator(
        plan.policy,
        eos,
        plan.torch_device,
        plan.torch_dtype,
        seed=seed,
        trust_remote_code=m.trust_remote_code,
        **{  # the engine settings, named as the generator names them
            **settings.model_dump(exclude={"lora"}),
            **plan.engines[role],
        },
        lora_rank=m.lora.r if m.lora is not None and settings.lora == "adapter" else None,
    )
    if m.lora is not None:
        return (AdapterLoraGenerator if settings.lora == "adapter" else MergedLoraGenerator)(engine, sampler)
    return engine


def make_searcher(
    sections: SearcherSections,
    plan: Plan,
    task: Task,
    tokenizer,
    sampler: torch.nn.Module | None,
    reference,
    weights: Receiver,
    searcher_id: int = 0,
) -> Searcher:
    """A searcher over ``sampler`` (vLLM: None, its engine holds the policy; or a LoRA policy's
    copy), sampling as the plan says for searcher ``searcher_id``."""
    g, t, m, seed = sections.generation, sections.trainer, sections.model, sections.seed
    eos = completion_eos(plan)
    sampling = plan.sampling[searcher_id % len(plan.sampling)]
    temperature, top_p = sampling["temperature"], sampling["top_p"]
    generator = make_generator(g, m, plan, sampler, tokenizer.pad_token_id, eos, seed * 1000 + searcher_id)
    if sampling["explore_temperature"] is not None:
        t_range = tuple(sampling["explore_temperature"])
        generator = ExploringGenerator(
            generator, g.explore_prob, t_range, g.explore_top_p, seed=seed * 1000 + searcher_id
        )
    params = SamplingParams(
        n=plan.samples_per_prompt,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=g.max_new_tokens,
        min_new_tokens=g.min_new_tokens,
        logprobs=plan.sampler_logprobs != "none",
        sampled_logprobs=plan.sampler_logprobs == "sampling_pass",
    )
    kind, streaming = Searcher, {}
    device_type = plan.torch_device.type
    conversations = make_conversations(sections.task, tokenizer, eos)  # None for a single-turn task
    if conversations is None and plan.stream != "batch":
        exact = plan.exact_stream  # each step: its batch's prompts, all of them to the end
        in_flight = plan.max_in_flight
        quarter = max(1, in_flight // 4)
        engine = generator.engine if isinstance(generator, LoraEngine) else generator
        stream = open_stream(
            plan.stream,
            engine if plan.stream == "vllm" else generator,
            params,
            in_flight,
            refill=plan.refill,
            seed=seed * 1000 + searcher_id,
            loader=generator,
        )
        kind = StreamingSearcher
        streaming = {
            "stream": stream,
            "max_in_flight": in_flight,
            "weight_update": g.weight_update,
            "exact": exact,
            "min_groups_out": quarter,  # reference passes and sends in a few larger pieces, not one per group
            "reward_workers": g.reward_workers,
            # beside the engine on an accelerator; on a CPU the engine has the cores already. Not for a
            # LoRA reference (the sampler itself, adapter off: calls must not overlap) nor TBA′ (which
            # reloads the reference between steps)
            "reference_thread": device_type == "cuda"
            and not isinstance(reference, ReferenceView)
            and plan.ref_reset_every is None,
        }
    return kind(
        task,
        tokenizer,
        generator,
        reference,
        weights,
        params,
        g.prompts_per_batch,
        eos,
        searcher_id=searcher_id,
        seed=seed,
        chat_template=m.chat_template,
        unfinished_reward=g.unfinished_reward,
        ref_reset_every=plan.ref_reset_every,
        # the reference pass is cut as the trainer's forward passes are (it holds no activations for
        # a backward pass, so what fits the trainer fits it)
        ref_micro_batch=t.micro_batch_prompts * plan.samples_per_prompt if t.micro_batch_prompts else None,
        ref_max_tokens=t.micro_batch_tokens,
        ref_packing=t.reference_packing,
        ref_row_tokens=t.packing_row_tokens,
        reward_timeout=sections.task.reward_timeout,
        conversations=conversations,
        **streaming,
    )


def build_searcher(
    sections: SearcherSections, plan: Plan, weights: Receiver, searcher_id: int = 0, log=print
) -> Searcher:
    """A searcher with its own sampling copy of the policy and its own reference model (for a
    searcher process: it loads the weights that the trainer publishes). With ``model.lora`` the
    sampler carries an adapter (filled by the trainer's first publication) and the reference is the
    same module with the adapter switched off: one copy of the base weights."""
    quiet_transformers()
    device = plan.torch_device
    m = sections.model
    tokenizer = load_tokenizer(m.tokenizer or plan.policy, m.trust_remote_code)
    task = make_task(sections.task, m.chat_template, tokenizer, log)
    task.setup(device)  # task-owned models live in searcher processes, never in the trainer
    sampler = None  # with vLLM the engine loads the policy itself
    if sections.generation.backend == "hf" or m.lora is not None:  # vLLM with LoRA: the adapter's base, merged from
        sampler = load_causal_lm(plan.policy, device, plan.dtype, m.trust_remote_code, trainable=False)
    if m.lora is not None:
        sampler = add_adapter(sampler, m.lora).eval().requires_grad_(False)
        reference = ReferenceView(sampler)
    else:
        reference = load_causal_lm(plan.reference, device, plan.dtype, m.trust_remote_code, trainable=False)
    # a searcher process: its engine's memory and sleep are the plan's for a searcher
    return make_searcher(sections, plan, task, tokenizer, sampler, reference, weights, searcher_id)


def build_components(
    cfg: Config,
    plan: Plan,
    log=print,
    weights: Sender | None = None,
    with_searcher: bool = True,
    prepared: tuple[Task, object] | None = None,
) -> Components:
    """Everything one process needs: the trainer side, and (for the sync runtime) a searcher that
    shares the process but samples from its own copy of the policy. ``plan``: the run's, ready
    (:func:`tba.runtime.preflight.ready_plan`: models built and checked, EOS ids known);
    ``prepared``: what :func:`tba.runtime.preflight.prepare_task` returned, if the caller checked
    the task already."""
    quiet_transformers()
    task, prepared_tokenizer = prepared or prepare_task(cfg.model, cfg.task, cfg.objective, cfg.eval.samples, log)
    eos = completion_eos(plan)
    device = plan.torch_device
    m, t = cfg.model, cfg.trainer
    tokenizer = policy_tokenizer(m, plan, prepared_tokenizer)
    precision = Precision(plan.precision, device.type)
    precision.warn(log)
    ranks = None
    if t.num_ranks > 1:  # this process keeps an unsharded copy, for evaluation and checkpoints
        # in the ray runtime on CPU: the GPUs are the ranks' and the searchers'
        copy_device = torch.device("cpu") if plan.runtime == "ray" else device
        policy = load_trainer_policy(m, t, plan.policy, copy_device, precision, gradient_checkpointing=False)
    else:
        policy = load_trainer_policy(m, t, plan.policy, device, precision)
    pad = tokenizer.pad_token_id
    if t.num_ranks > 1:
        # a LoRA adapter starts from this copy's random initialisation; a full model from its file
        initial = policy_state(policy) if m.lora is not None else None
        ranks = RankGroup(cfg.model_dump(mode="json"), t, cfg.objective, plan, pad, eos, log, initial=initial)
    lag = plan.extra_lag
    weights = weights or LocalWeightStore(keep=publications_to_keep(lag, t.sync_interval))
    buffer = make_buffer(cfg.buffer, cfg.run.seed, plan)
    trainer = make_trainer(
        t,
        cfg.objective,
        cfg.generation,
        plan,
        policy,
        pad,
        eos,
        precision,
        buffer=buffer,
        weights=weights,
        # searchers hold model.dtype; a LoRA adapter stays as PEFT keeps it there (fp32)
        publish_dtype=None if m.lora is not None else plan.torch_dtype,
        ranks=ranks,
    )
    attention = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    log(f"trainer passes: {trainer.passes.describe()} ({attention} attention)")
    searcher = None
    if with_searcher:
        # The searcher samples from its own copy of the policy, refreshed only when the trainer
        # publishes, so its data is tagged with the version that really produced it. A LoRA
        # sampler shares the frozen base weights with the policy and copies only the adapter.
        task.setup(device)
        sampler = None  # with vLLM the engine loads the policy itself (a LoRA one: merged from this copy)
        if cfg.generation.backend == "hf" or m.lora is not None:
            sampler = copy_sharing_frozen(policy).eval().requires_grad_(False)
            if m.lora is None:  # the searchers' dtype, not the trainer's master weights
                sampler = sampler.to(plan.torch_dtype)
        if m.lora is not None:
            reference = ReferenceView(sampler)
        else:
            reference = load_causal_lm(plan.reference, device, plan.dtype, m.trust_remote_code, trainable=False)
        seen = DelayedWeights(weights, lag) if lag else weights  # runtime.extra_lag: older weights
        sections = SearcherSections(cfg.generation, t, m, cfg.task, cfg.run.seed)
        searcher = make_searcher(sections, plan, task, tokenizer, sampler, reference, seen)
    settings = eval_settings(cfg.eval, cfg.generation, t.reference_packing, m.chat_template)
    c = Components(task, tokenizer, policy, buffer, trainer, searcher, eos, plan, cfg.task.name, settings)
    c.new_evaluator = lambda: trainer_evaluator(
        c, make_conversations(cfg.task, tokenizer, eos), m, cfg.generation.backend
    )
    return c


def load_evaluator(
    cfg: Config,
    plan: Plan,
    checkpoint: Path | None = None,
    log=print,
    prepared: tuple[Task, object] | None = None,
) -> Evaluator:
    """An evaluator built from the config alone: the task (checked, as ``tba train`` checks it), the
    tokenizer, and the policy: ``model.policy``, or a checkpoint of a run of this config (a full
    model loads from the checkpoint itself; a LoRA adapter goes onto ``model.policy``). The
    reference (``model.reference``, else ``model.policy``) loads only if the task asks for it.
    ``plan``: the run's, ready (:func:`tba.runtime.preflight.ready_plan`); ``prepared``: what
    :func:`tba.runtime.preflight.prepare_task` returned, if the caller has it."""
    m = cfg.model
    task, tokenizer = prepared or prepare_task(m, cfg.task, cfg.objective, cfg.eval.samples, log)
    device = plan.torch_device
    if checkpoint is not None and m.lora is None:
        policy = load_causal_lm(str(checkpoint), device, plan.dtype, m.trust_remote_code, trainable=False)
    else:
        policy = load_causal_lm(plan.policy, device, plan.dtype, m.trust_remote_code, trainable=False)
        if m.lora is not None:
            policy = add_adapter(policy, m.lora).eval().requires_grad_(False)
            if checkpoint is not None:
                load_policy_weights(policy, checkpoint)
    eos = completion_eos(plan)
    generator = None
    if cfg.generation.backend == "vllm":
        # An engine on model.policy, then the checkpoint's weights: a checkpoint folder also holds
        # the trainer's state files, which vLLM would take for weight shards.
        sampler = policy if m.lora is not None else None
        seed = cfg.run.seed * 1000  # searcher 0's
        generator = make_generator(cfg.generation, m, plan, sampler, tokenizer.pad_token_id, eos, seed, "evaluation")
        log(f"generation: a vLLM engine on {plan.policy}")
        if checkpoint is not None:
            generator.load_weights(published_state(policy), version=-1)
    settings = eval_settings(cfg.eval, cfg.generation, cfg.trainer.reference_packing, m.chat_template)
    conversations = make_conversations(cfg.task, tokenizer, eos)
    return Evaluator(settings, task, tokenizer, policy, eos, lazy_reference(m, plan, policy), generator, conversations)
