"""The ``run`` and ``model`` sections: where a run writes and resumes, and the models it loads (LoRA included)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tba.config.section import Section


class RunConfig(Section):
    output_dir: str = "runs"
    """Parent folder of run directories."""
    name: str | None = None
    """Run directory name under ``output_dir``; default: ``<task>-<date>-<time>``."""
    seed: int = 0
    """Seed for torch, numpy and Python's random (data order, sampling, initialisation)."""
    threads: int | None = None
    """torch CPU threads for this process; default: the run plan's. The sync runtime: every usable
    core (torch's default) less those that other processes keep busy when the run starts; the ray
    runtime's trainer: the cores its searchers leave, less the busy ones; a resumed run: the
    threads it started with (the count decides how sums round)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    resume: bool = False
    """Continue the run in ``output_dir/name`` from its latest checkpoint (needs ``name``)."""

    @model_validator(mode="after")
    def _check_resume(self) -> RunConfig:
        if self.resume and not self.name:
            raise ValueError("resume=true needs run.name: the directory of the run to continue")
        return self


class LoraConfig(Section):
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


class ModelConfig(Section):
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
