"""The rules that span sections, run on a :class:`~tba.config.schema.Config` as it is validated: each
raises ValueError with the keys involved and the fix (:func:`tba.config.errors.format_error` makes
it one line)."""

from __future__ import annotations

from tba.weights.transports import transport


def check_batches(cfg) -> None:
    """Batch and buffer sizes that fit together."""
    t, b = cfg.trainer, cfg.buffer
    micro, batch, k = t.micro_batch_prompts, t.batch_prompts, cfg.generation.group_size
    if micro is not None and (micro < 1 or batch % micro):
        raise ValueError(
            f"trainer.micro_batch_prompts {micro} does not divide trainer.batch_prompts {batch}; "
            f"use a divisor of {batch}, or unset it for one pass per batch"
        )
    if b.per_prompt_capacity is not None and b.per_prompt_capacity < b.min_completions:
        raise ValueError(
            f"buffer.per_prompt_capacity {b.per_prompt_capacity} is below buffer.min_completions "
            f"{b.min_completions}: no prompt could ever be drawn; raise per_prompt_capacity"
        )
    if b.capacity < batch * k:
        raise ValueError(
            f"buffer.capacity {b.capacity} holds fewer completions than one batch (trainer.batch_prompts {batch} "
            f"x generation.group_size {k} = {batch * k}), so training would wait forever; raise buffer.capacity"
        )


def check_runtime(cfg) -> None:
    """Settings that only one runtime supports (exact staleness: sync; evaluation in an actor: ray),
    and settings that exclude each other."""
    b, batch, k = cfg.buffer, cfg.trainer.batch_prompts, cfg.generation.group_size
    for key, on in (("buffer.fresh_only=true", b.fresh_only), ("runtime.extra_lag", cfg.runtime.extra_lag)):
        if on and (cfg.runtime.type == "ray" or cfg.eval.async_):
            raise ValueError(
                f"{key} controls staleness in the sync runtime, where generation and training "
                "alternate; set runtime.type=sync"
                + (" and drop eval.async (an actor beside the trainer needs ray)" if cfg.eval.async_ else "")
            )
    if cfg.generation.stream is True and cfg.generation.backend == "vllm" and cfg.generation.vllm.sleep:
        raise ValueError(
            "generation.stream with generation.vllm.sleep=true: sleep mode frees the engine's KV cache "
            "between generation calls, which would abort a stream's requests in flight; a streaming "
            "searcher keeps its engine awake: set generation.vllm.sleep=false"
        )
    if cfg.model.chat_template is False and cfg.task.multi_turn:
        raise ValueError(
            "model.chat_template=false with task.tools, task.environment or task.agent: a conversation's turns are "
            "written by the chat template; leave model.chat_template unset (or true)"
        )
    if cfg.generation.stream is True and cfg.task.multi_turn:
        raise ValueError(
            "generation.stream with task.tools, task.environment or task.agent: a conversation goes turn by turn "
            "through the environment, which streams do not do yet; set generation.stream=false"
        )
    if cfg.generation.stream is True and cfg.generation.explore_prob > 0:
        raise ValueError(
            "generation.stream takes no generation.explore_prob: exploration draws its settings per "
            "batch, and a stream has no batches; set one of them off"
        )
    if b.fresh_only and cfg.generation.prompts_per_batch != batch:
        raise ValueError(
            f"buffer.fresh_only=true trains each step on the groups just generated, so "
            f"generation.prompts_per_batch ({cfg.generation.prompts_per_batch}) must equal "
            f"trainer.batch_prompts ({batch})"
        )
    if b.fresh_only and cfg.generation.samples_per_prompt not in (None, k):
        raise ValueError(
            f"buffer.fresh_only=true trains on every sampled completion: generation.samples_per_prompt "
            f"({cfg.generation.samples_per_prompt}) must be unset or equal generation.group_size ({k})"
        )
    if cfg.runtime.extra_lag and cfg.run.resume:
        raise ValueError(
            "run.resume with runtime.extra_lag: the delayed weights the searcher would load next are not "
            "in the checkpoint; start the run afresh"
        )
    k, lag = cfg.trainer.sync_interval, cfg.runtime.max_lag
    if isinstance(lag, int) and lag < k:  # (auto is 4 x sync_interval: tba.plan.auto.lag_bound)
        raise ValueError(
            f"runtime.max_lag={lag} is below trainer.sync_interval={k}: searchers only get weights every {k} "
            f"steps, so the trainer would wait for weights it has not published; raise max_lag to at least {k} "
            "or lower sync_interval"
        )
    share = cfg.runtime.searcher_gpus
    fraction = cfg.generation.vllm.gpu_memory_utilization
    fractional = share is not None and 0 < share < 1
    if cfg.runtime.type != "sync" and fraction is not None and fractional and fraction > share:
        raise ValueError(
            f"generation.vllm.gpu_memory_utilization={fraction} is more than a searcher's share of its GPU "
            f"(runtime.searcher_gpus={share}): the searchers that share a GPU would not all fit. Set it below "
            f"{share} (the rest of the share holds the searcher's reference model), or unset it"
        )
    ranks = 1 if cfg.trainer.num_ranks == "auto" else cfg.trainer.num_ranks  # (the plan's, within these rules)
    if ranks > 1 and batch < ranks:
        raise ValueError(
            f"trainer.num_ranks={ranks} splits each batch's groups over the ranks, and trainer.batch_prompts="
            f"{batch} gives some rank none; raise batch_prompts to at least {ranks} or lower num_ranks"
        )
    name = cfg.runtime.weight_transport
    chosen = transport(name) if name != "auto" else None
    if chosen is not None and chosen.primary and cfg.runtime.type == "sync":
        raise ValueError(
            f"runtime.weight_transport={name} sends weights to searcher processes, and the sync runtime "
            "has none (its searcher shares the trainer's process); set runtime.type=ray or drop weight_transport"
        )
    if chosen is not None and not chosen.serves_ranks and ranks > 1:
        raise ValueError(
            f"runtime.weight_transport={name} cannot serve trainer ranks ({chosen.summary}; the ranks hold "
            "GPUs of their own); set runtime.weight_transport=object_store, broadcast or auto"
        )
    if chosen is not None and chosen.same_machine and (cfg.runtime.address or cfg.runtime.searcher_resources):
        raise ValueError(
            f"runtime.weight_transport={name} needs searchers on the trainer's machine, and "
            f"runtime.{'address' if cfg.runtime.address else 'searcher_resources'} may place them on others; "
            "set runtime.weight_transport=broadcast (or object_store)"
        )
    if cfg.eval.async_ and cfg.runtime.type == "sync":
        raise ValueError(
            "eval.async=true evaluates in a Ray actor beside the trainer, which needs runtime.type=ray; "
            "drop eval.async for the sync runtime"
        )
