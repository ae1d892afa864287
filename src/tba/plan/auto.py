"""The rules that decide a setting left at ``auto`` from the rest of the config and the machine.

The run plan (:func:`tba.plan.core.make_plan`) and the builders call them; a config section only
holds what the user asked for. Each rule says why it decides as it does.
"""

from __future__ import annotations

import math

from tba.config import (
    BufferConfig,
    Config,
    GenerationConfig,
    ObjectiveConfig,
    RuntimeConfig,
    TrainerConfig,
    VLLMSettings,
)
from tba.objectives.needs import needs


def engine_memory_fraction(settings: VLLMSettings, gpu_share: float | None) -> float:
    """A vLLM engine's ``gpu_memory_utilization`` in a process given ``gpu_share`` of a GPU (None: a
    process that shares its GPU with the trainer): three quarters of its share (the rest holds the
    searcher's reference model), 0.35 beside the trainer."""
    if settings.gpu_memory_utilization is not None:
        return settings.gpu_memory_utilization
    return 0.75 * min(gpu_share, 1.0) if gpu_share else 0.35


def engine_sleeps(settings: VLLMSettings, device_type: str, gpu_share: float | None) -> bool:
    """Whether a vLLM engine on ``device_type`` given ``gpu_share`` of a GPU (None: it shares the
    trainer's process and GPU) uses sleep mode: only where it shares the trainer's GPU."""
    if settings.sleep is not None:
        return settings.sleep
    return device_type == "cuda" and gpu_share is None


def streams(generation: GenerationConfig, runtime: str, device_type: str) -> bool:
    """``generation.stream`` for ``runtime`` (``runtime.type``) on ``device_type``: a stream where an
    engine serves long completions in the ray runtime."""
    if generation.stream != "auto":
        return generation.stream
    # HF's continuous batching on a CPU attends over every sequence in flight at once (a packed
    # row, a block-diagonal mask): slower than padded batches there
    engine = generation.backend == "vllm" or device_type == "cuda"
    long = generation.max_new_tokens >= 256
    return runtime == "ray" and engine and long and generation.explore_prob == 0 and generation.vllm.sleep is not True


def flat_weight(buffer: BufferConfig, runtime: str) -> float:
    """``buffer.flat_weight`` for ``runtime``: groups with reward contrast first (0) in the ray
    runtime, where searchers outpace the trainer and the recent window holds more than a batch;
    uniform (1) in sync."""
    if buffer.flat_weight == "auto":
        return 0.0 if runtime == "ray" else 1.0
    return buffer.flat_weight


def lag_bound(runtime: RuntimeConfig, sync_interval: int) -> int | None:
    """``runtime.max_lag`` in versions: 4 x ``trainer.sync_interval`` for ``auto``."""
    return 4 * sync_interval if runtime.max_lag == "auto" else runtime.max_lag


def replay_window(cfg: Config) -> int:
    """``trainer.replay_window``, or for None the larger of 16 steps and twice a round of the
    searchers' batches in steps (``num_searchers`` x ``prompts_per_batch`` / ``batch_prompts``): with
    many searchers a window shorter than their round holds the trainer back
    (``benchmarks/results/scale/README.md``)."""
    if cfg.trainer.replay_window is not None:
        return cfg.trainer.replay_window
    per_round = cfg.runtime.num_searchers * cfg.generation.prompts_per_batch / cfg.trainer.batch_prompts
    return max(16, math.ceil(2 * per_round))


def stale_by_design(cfg: Config) -> bool:
    """Whether the run trains on data whose sampler lags the trainer by design: the ray runtime, or
    sync with ``runtime.extra_lag``."""
    return cfg.runtime.type != "sync" or cfg.runtime.extra_lag > 0


def tb_trust_region(objective: ObjectiveConfig, stale: bool = True) -> float | None:
    """``objective.tb_trust_region``: for ``auto``, the sequence band (0.5) where trajectory balance
    trains on data stale by design (``stale``), else plain TB: in the sync runtime the band steadied
    small batches but cost the tool demo accuracy (``benchmarks/results/async_regimes/README.md``)."""
    if not needs(objective).balance:
        return None
    if objective.tb_trust_region == "auto":
        return 0.5 if stale else None
    return objective.tb_trust_region


def needs_sampler_logps(objective: ObjectiveConfig, trust_region: float | None) -> bool:
    """Whether searchers must record the sampling policy's per-token log-probs: the ratio objectives,
    Proximal RLOO or RLOO with ``tis_cap``, and trajectory balance with a band (``trust_region``),
    the second-moment filter or the ESS learning rate."""
    return needs(objective).sampler_logps(objective, trust_region)


def grad_clip(trainer: TrainerConfig, objective: ObjectiveConfig | str) -> float | None:
    """``trainer.grad_clip``: for ``auto``, the objective's (none for trajectory balance, 1.0 for the
    baselines: :mod:`tba.objectives.needs`)."""
    if trainer.grad_clip == "auto":
        return needs(objective).grad_clip
    return trainer.grad_clip
