"""Build a run's parts from its config: task, tokenizer, models, buffer, searcher, trainer.

Shared by every runtime, so the sync and (later) distributed runtimes train the same thing.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tba.buffer import ReplayBuffer
from tba.checkpoint import latest_checkpoint
from tba.config import ArithmeticTaskConfig, Config, ConfigError
from tba.errors import RunDirError
from tba.evaluation import Evaluator
from tba.generation.base import Generator, SamplingParams
from tba.generation.explore import ExploringGenerator
from tba.generation.hf import HFGenerator
from tba.models.loading import (
    check_causal_lm,
    eos_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from tba.models.logprobs import unwrap
from tba.models.lora import (
    ReferenceView,
    add_adapter,
    check_lora_config,
    copy_sharing_frozen,
    policy_state,
    published_state,
)
from tba.models.precision import Precision
from tba.models.tiny import BUILTIN_PREFIX, build_char_tokenizer, ensure_tiny_model
from tba.searcher import Searcher
from tba.tasks import Task, build_task
from tba.trainer import Trainer
from tba.weights import DelayedWeights, LocalWeightStore, WeightStore, publications_to_keep


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_model_path(name: str, cfg: Config, log=print) -> str:
    """A Hugging Face id or local path; ``builtin:`` names are built and cached on first use."""
    if not name.startswith(BUILTIN_PREFIX):
        return name
    if name != "builtin:tiny-arithmetic":
        raise ConfigError(f"unknown built-in model {name!r}; the built-in model is builtin:tiny-arithmetic")
    # Warm-started on the arithmetic task's setting; other tasks get the default demo model.
    warm = cfg.task if cfg.task.name == "arithmetic" else ArithmeticTaskConfig()
    return str(ensure_tiny_model(warm, cfg.model.cache_dir, log=log))


@dataclass
class Components:
    task: Task
    tokenizer: object
    policy: torch.nn.Module
    buffer: ReplayBuffer
    trainer: Trainer
    searcher: Searcher | None
    eos_ids: set[int]
    policy_path: str
    evaluator: Evaluator | None = None  # of the policy, built on first evaluation

    def close(self) -> None:
        """Stop what runs outside this process for these parts (the trainer's ranks, if any)."""
        if self.trainer.ranks is not None:
            self.trainer.ranks.close()


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file loading bars would bury the run's own progress


def model_paths(cfg: Config, log=print) -> tuple[str, str]:
    """(policy, reference) as loadable ids or paths; builds the demo model on first use."""
    policy_path = resolve_model_path(cfg.model.policy, cfg, log)
    ref_path = resolve_model_path(cfg.model.reference, cfg, log) if cfg.model.reference else policy_path
    return policy_path, ref_path


def check_models(cfg: Config, log=print) -> None:
    """Resolve the policy and the reference (building the demo model on first use) and check, from
    their configs alone, that each exists and is a causal LM: before the run directory exists."""
    policy_path, ref_path = model_paths(cfg, log)
    config = check_causal_lm(policy_path, cfg.model.trust_remote_code, what="model.policy")
    if ref_path != policy_path:
        check_causal_lm(ref_path, cfg.model.trust_remote_code, what="model.reference")
    if cfg.generation.backend == "vllm":
        from tba.generation.vllm_backend import check_vllm_backend

        check_vllm_backend(config, resolve_device(cfg.run.device), sleep=cfg.generation.vllm.sleep)


def make_buffer(cfg: Config) -> ReplayBuffer:
    b = cfg.buffer
    return ReplayBuffer(
        capacity=b.capacity,
        per_prompt_capacity=b.per_prompt_capacity,
        recent_prob=b.recent_prob,
        reward_inv_temp=b.reward_inv_temp,
        min_completions=b.min_completions,
        seed=cfg.run.seed,
    )


def completion_eos(cfg: Config, tokenizer, model) -> set[int]:
    return eos_ids(tokenizer, model, cfg.model.eos_tokens, cfg.model.chat_template)


def make_task(cfg: Config, tokenizer=None, log=print) -> Task:
    return build_task(cfg.task, tokenizer=tokenizer, chat_template=cfg.model.chat_template, log=log)


def prepare_task(cfg: Config, log=print) -> tuple[Task, object]:
    """The task and the tokenizer, checked before any model is loaded (or, for the demo model,
    built): the dataset loads, its prompts fit, and the reward functions score two evaluation
    rows; ``model.lora`` settings fit LoRA's reference. Raises with a message that says what to fix."""
    quiet_transformers()
    check_lora_config(cfg)
    m = cfg.model
    if m.tokenizer is None and m.policy.startswith(BUILTIN_PREFIX):
        tokenizer = build_char_tokenizer()  # the demo model's tokenizer, without building the model
    else:
        what = "model.tokenizer" if m.tokenizer else "model.policy"
        tokenizer = load_tokenizer(m.tokenizer or m.policy, m.trust_remote_code, what=what)
    task = make_task(cfg, tokenizer, log)
    task.check()
    if cfg.eval.samples > 1 and not task.success_scores:
        raise ConfigError(
            f"eval.samples={cfg.eval.samples} asks for pass@k, which needs a success score: "
            "set task.success_threshold (a reward at or above it is a success)"
        )
    log(task.describe())
    return task, tokenizer


def make_generator(
    cfg: Config,
    sampler: torch.nn.Module | None,
    pad_id: int,
    eos: set[int],
    searcher_id: int = 0,
    gpu_share: float | None = None,
) -> Generator:
    """The searcher's generation backend: HF ``generate`` over ``sampler``, or a vLLM engine that
    loads ``model.policy`` itself (``sampler`` is then None, or for a LoRA policy the PEFT copy
    whose merged weights the engine is handed at each publication). ``gpu_share``: this process's
    share of its GPU (None: it shares the GPU with the trainer), which sizes the engine's memory."""
    if cfg.generation.backend == "hf":
        return HFGenerator(sampler, pad_id, eos)
    from tba.generation.vllm_backend import MergedLoraGenerator, VLLMGenerator

    device = resolve_device(cfg.run.device)
    policy_path, _ = model_paths(cfg)
    settings = cfg.generation.vllm
    engine = VLLMGenerator(
        policy_path,
        eos,
        device,
        resolve_dtype(cfg.model.dtype, device),
        seed=cfg.run.seed * 1000 + searcher_id,
        trust_remote_code=cfg.model.trust_remote_code,
        **{  # the engine settings, named as the generator names them
            **settings.model_dump(),
            "gpu_memory_utilization": settings.memory_fraction(gpu_share),
            "sleep": settings.sleeps(device.type, gpu_share),
        },
    )
    if cfg.model.lora is not None:
        return MergedLoraGenerator(engine, sampler)
    return engine


def make_searcher(
    cfg: Config,
    task: Task,
    tokenizer,
    sampler: torch.nn.Module | None,
    reference,
    weights: WeightStore,
    searcher_id: int = 0,
    gpu_share: float | None = None,
) -> Searcher:
    """A searcher over ``sampler`` (with the vLLM backend, whose engine holds the policy: None, or a
    LoRA policy's PEFT copy)."""
    g, t = cfg.generation, cfg.trainer
    eos = completion_eos(cfg, tokenizer, sampler if sampler is not None else reference)
    temperature = (
        g.searcher_temperatures[searcher_id % len(g.searcher_temperatures)]
        if g.searcher_temperatures
        else g.temperature
    )
    top_p = g.searcher_top_ps[searcher_id % len(g.searcher_top_ps)] if g.searcher_top_ps else g.top_p
    generator = make_generator(cfg, sampler, tokenizer.pad_token_id, eos, searcher_id, gpu_share)
    if g.explore_prob > 0:
        t_range = g.explore_temperature or (temperature, temperature * 1.1 / 0.7)
        generator = ExploringGenerator(
            generator, g.explore_prob, t_range, g.explore_top_p, seed=cfg.run.seed * 1000 + searcher_id
        )
    return Searcher(
        task,
        tokenizer,
        generator,
        reference,
        weights,
        SamplingParams(
            n=g.samples_per_prompt or g.group_size,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens,
            logprobs=cfg.objective.needs_sampler_logps,
        ),
        g.prompts_per_batch,
        eos,
        searcher_id=searcher_id,
        seed=cfg.run.seed,
        chat_template=cfg.model.chat_template,
        unfinished_reward=g.unfinished_reward,
        ref_reset_every=cfg.objective.ref_reset_every if cfg.objective.type == "tb" else None,
        # the reference pass is cut as the trainer's forward passes are (it holds no activations for
        # a backward pass, so what fits the trainer fits it)
        ref_micro_batch=t.micro_batch_prompts * (g.samples_per_prompt or g.group_size)
        if t.micro_batch_prompts
        else None,
        ref_max_tokens=t.micro_batch_tokens,
    )


def build_searcher(cfg: Config, weights: WeightStore, searcher_id: int = 0, log=print) -> Searcher:
    """A searcher with its own sampling copy of the policy and its own reference model (for a
    searcher process: it loads the weights that the trainer publishes). With ``model.lora`` the
    sampler carries an adapter (filled by the trainer's first publication) and the reference is the
    same module with the adapter switched off: one copy of the base weights."""
    quiet_transformers()
    device = resolve_device(cfg.run.device)
    policy_path, ref_path = model_paths(cfg, log)
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer or policy_path, m.trust_remote_code)
    task = make_task(cfg, tokenizer, log)
    task.setup(device)  # task-owned models live in searcher processes, never in the trainer
    sampler = None  # with vLLM the engine loads the policy itself
    if cfg.generation.backend == "hf" or m.lora is not None:  # vLLM with LoRA: the adapter's base, merged from
        sampler = load_causal_lm(policy_path, device, m.dtype, m.trust_remote_code, trainable=False)
    if m.lora is not None:
        sampler = add_adapter(sampler, m.lora).eval().requires_grad_(False)
        reference = ReferenceView(sampler)
    else:
        reference = load_causal_lm(ref_path, device, m.dtype, m.trust_remote_code, trainable=False)
    # a searcher process: its share of a GPU is runtime.searcher_gpus
    return make_searcher(cfg, task, tokenizer, sampler, reference, weights, searcher_id, cfg.runtime.searcher_gpus)


def load_trainer_policy(
    cfg: Config, path: str, device: torch.device, precision: Precision, gradient_checkpointing: bool = True
) -> torch.nn.Module:
    """The policy the trainer updates, in ``precision``'s weights dtype (fp32 master weights for
    bf16-mixed). With LoRA only the adapter trains: the frozen base stays in ``model.dtype`` unless
    the precision is fp32, and PEFT keeps the adapter in fp32 (cast to bf16 for pure bf16)."""
    m = cfg.model
    dtype = precision.weights_dtype_name()
    if m.lora is not None and precision.mode == "bf16-mixed":
        dtype = m.dtype
    policy = load_causal_lm(path, device, dtype, m.trust_remote_code)
    if m.lora is not None:
        policy = add_adapter(policy, m.lora)  # only the adapter trains; the base is the reference
        if precision.mode == "bf16":
            policy = policy.to(torch.bfloat16)
    if cfg.trainer.gradient_checkpointing and gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (it needs no
    input that requires grad, so it works under a LoRA adapter). A model without it is a config error."""
    base = unwrap(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"trainer.gradient_checkpointing=true, but {type(base).__name__} does not support activation "
            "checkpointing in transformers; set it to false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_components(
    cfg: Config,
    log=print,
    weights: WeightStore | None = None,
    with_searcher: bool = True,
    prepared: tuple[Task, object] | None = None,
) -> Components:
    """Everything one process needs: the trainer side, and (for the sync runtime) a searcher that
    shares the process but samples from its own copy of the policy. ``prepared`` is what
    :func:`prepare_task` returned, if the caller checked the task already."""
    quiet_transformers()
    device = resolve_device(cfg.run.device)
    task, _ = prepared or prepare_task(cfg, log)
    policy_path, ref_path = model_paths(cfg, log)
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer or policy_path, m.trust_remote_code)
    precision = Precision.from_config(cfg.trainer.precision, device)
    precision.warn(log)
    ranks = None
    if cfg.trainer.num_ranks > 1:  # this process keeps an unsharded copy, for evaluation and checkpoints
        # in the ray runtime on CPU: the GPUs are the ranks' and the searchers'
        copy_device = torch.device("cpu") if cfg.runtime.type == "ray" else device
        policy = load_trainer_policy(cfg, policy_path, copy_device, precision, gradient_checkpointing=False)
    else:
        policy = load_trainer_policy(cfg, policy_path, device, precision)
    eos = completion_eos(cfg, tokenizer, policy)
    pad = tokenizer.pad_token_id
    if cfg.trainer.num_ranks > 1:
        from tba.runtime.ranks import RankGroup

        # a LoRA adapter starts from this copy's random initialisation; a full model from its file
        ranks = RankGroup(cfg, pad, eos, log, initial=policy_state(policy) if m.lora is not None else None)
    lag = cfg.runtime.extra_lag
    weights = weights or LocalWeightStore(keep=publications_to_keep(lag, cfg.trainer.sync_interval))
    buffer = make_buffer(cfg)
    trainer = Trainer(
        policy,
        buffer,
        weights,
        cfg.trainer,
        cfg.objective,
        cfg.generation.group_size,
        pad,
        eos,
        max_new_tokens=cfg.generation.max_new_tokens,
        precision=precision,
        # searchers hold model.dtype; a LoRA adapter stays as PEFT keeps it there (fp32)
        publish_dtype=None if m.lora is not None else resolve_dtype(m.dtype, device),
        ranks=ranks,
    )
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
                sampler = sampler.to(resolve_dtype(m.dtype, device))
        if m.lora is not None:
            reference = ReferenceView(sampler)
        else:
            reference = load_causal_lm(ref_path, device, m.dtype, m.trust_remote_code, trainable=False)
        seen = DelayedWeights(weights, lag) if lag else weights  # runtime.extra_lag: older weights
        searcher = make_searcher(cfg, task, tokenizer, sampler, reference, seen)
    return Components(
        task,
        tokenizer,
        policy,
        buffer,
        trainer,
        searcher,
        eos,
        policy_path,
    )


def load_evaluator(cfg: Config, checkpoint: Path | None = None, log=print, gpu_share: float | None = 1.0) -> Evaluator:
    """An evaluator built from the config alone: the task (checked, as ``tba train`` checks it), the
    tokenizer, and the policy: ``model.policy``, or a checkpoint of a run of this config (a full
    model loads from the checkpoint itself; a LoRA adapter goes onto ``model.policy``). The
    reference (``model.reference``, else ``model.policy``) loads only if the task asks for it."""
    device = resolve_device(cfg.run.device)
    m = cfg.model
    task, tokenizer = prepare_task(cfg, log)
    if checkpoint is not None and m.lora is None:
        policy = load_causal_lm(str(checkpoint), device, m.dtype, m.trust_remote_code, trainable=False)
    else:
        policy_path, _ = model_paths(cfg, log)
        policy = load_causal_lm(policy_path, device, m.dtype, m.trust_remote_code, trainable=False)
        if m.lora is not None:
            policy = add_adapter(policy, m.lora).eval().requires_grad_(False)
            if checkpoint is not None:
                from tba.checkpoint import load_policy_weights

                load_policy_weights(policy, checkpoint)
    eos = completion_eos(cfg, tokenizer, policy)
    generator = None
    if cfg.generation.backend == "vllm":
        # An engine on model.policy, then the checkpoint's weights: a checkpoint folder also holds
        # the trainer's state files, which vLLM would take for weight shards.
        sampler = policy if m.lora is not None else None
        generator = make_generator(cfg, sampler, tokenizer.pad_token_id, eos, gpu_share=gpu_share)
        log(f"generation: a vLLM engine on {model_paths(cfg)[0]}")
        if checkpoint is not None:
            generator.load_weights(published_state(policy), version=-1)
    return Evaluator(cfg, task, tokenizer, policy, eos, lazy_reference(cfg, policy, log), generator)


def lazy_reference(cfg: Config, policy: torch.nn.Module, log=print):
    """The frozen reference for an evaluation that needs it (KL), as a function that builds it on
    its first call and then returns the same one: a LoRA policy's base model (the adapter switched
    off), else ``model.reference`` (or ``model.policy``) loaded beside ``policy``."""
    held: list[torch.nn.Module] = []

    def reference() -> torch.nn.Module:
        if not held:
            m = cfg.model
            if m.lora is not None:
                held.append(ReferenceView(policy))
            else:
                _, ref_path = model_paths(cfg, log)
                device = next(policy.parameters()).device
                held.append(load_causal_lm(ref_path, device, m.dtype, m.trust_remote_code, trainable=False))
        return held[0]

    return reference


def absolute_paths(cfg: Config) -> Config:
    """Local dataset files and reward-function files as absolute paths, so that searcher
    processes (whose working directory may differ) and a repeated run find them."""
    t = cfg.task
    updates: dict = {}
    for key in ("path", "eval_path"):
        value = getattr(t, key, None)
        if value and Path(value).expanduser().exists():
            updates[key] = str(Path(value).expanduser().resolve())
    funcs = getattr(t, "reward_funcs", None)
    if funcs:
        resolved = []
        for spec in funcs:
            file, sep, fn = spec.rpartition(":")
            if sep and file.endswith(".py") and Path(file).expanduser().is_file():
                spec = f"{Path(file).expanduser().resolve()}:{fn}"
            resolved.append(spec)
        updates["reward_funcs"] = resolved
    if not updates:
        return cfg
    return cfg.model_copy(update={"task": t.model_copy(update=updates)})


created_run_dirs: list[Path] = []
"""Run directories that :func:`prepare_run_dir` created in this process, so that a start that fails
can remove its own directory (:func:`remove_unstarted`) and leave the name free."""


def check_run_dir(cfg: Config) -> Path:
    """The run directory, checked without creating anything: a new run needs a free name and a
    writable ``run.output_dir``; a resume needs a checkpoint. Raises :class:`RunDirError`."""
    from datetime import datetime

    name = cfg.run.name or f"{cfg.task.name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(cfg.run.output_dir).expanduser() / name
    if cfg.run.resume:
        if not run_dir.is_dir():
            raise RunDirError(
                f"run.resume=true but {run_dir} does not exist; check run.output_dir and run.name, "
                "or drop --run.resume to start a new run"
            )
        if latest_checkpoint(run_dir) is None:
            raise RunDirError(
                f"run.resume=true but {run_dir} holds no checkpoint, so there is nothing to resume; "
                f"start afresh under another run.name (or delete {run_dir})"
            )
        return run_dir
    if run_dir.exists() and not unstarted(run_dir):
        raise RunDirError(
            f"run directory {run_dir} already holds a run; pick another run.name, "
            "or pass --run.resume=true to continue it"
        )
    parent = run_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "is a file, not a folder" if parent.exists() and not parent.is_dir() else "is not writable"
        raise RunDirError(
            f"cannot create run directory {run_dir}: {parent} {what}; set run.output_dir to a writable folder"
        )
    return run_dir


def prepare_run_dir(cfg: Config, run_dir: Path | None = None) -> Path:
    """Create (or reopen, on resume) the run directory that :func:`check_run_dir` approves."""
    run_dir = run_dir or check_run_dir(cfg)
    fresh = not run_dir.exists()
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "plots").mkdir(exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"cannot create run directory {run_dir}: {err.strerror or err}; set run.output_dir to a writable folder"
        ) from err
    if fresh:
        created_run_dirs.append(run_dir)
    return run_dir


def unstarted(run_dir: Path, step_zero: bool = False) -> bool:
    """The directory holds nothing a run wrote but ``config.yaml`` (and empty files or folders):
    the trace of a start that failed before training, which does not block reusing the name. With
    ``step_zero`` the records of the evaluation at step 0 (of the starting weights) count as
    nothing too: what a start that failed while its searchers started leaves in the ray runtime."""
    for path in run_dir.rglob("*"):
        if not path.is_file() or path.name == "config.yaml" or path.stat().st_size == 0:
            continue
        if step_zero and path.parent == run_dir and path.name in ("metrics.jsonl", "samples.jsonl"):
            if _step_zero_only(path):
                continue
        return False
    return True


def _step_zero_only(path: Path) -> bool:
    """Every line of a JSON-lines file is a record of step 0."""
    try:
        return all(json.loads(line).get("step") == 0 for line in path.read_text().splitlines() if line.strip())
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


def remove_unstarted(run_dir: Path, step_zero: bool = False) -> bool:
    """Delete ``run_dir`` if it holds no trace of training (see :func:`unstarted`); True if it did."""
    if run_dir.is_dir() and unstarted(run_dir, step_zero):
        shutil.rmtree(run_dir)
        return True
    return False
