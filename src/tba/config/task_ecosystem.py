"""The task sections of the ecosystem's packages: reasoning-gym's generators and verifiers'
environments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tba.config.section import Section
from tba.config.task_common import TaskSection


class ReasoningGymDataset(Section):
    """One reasoning-gym dataset of a mix."""

    name: str = Field(min_length=1)
    """Its name in reasoning-gym (``chain_sum``, ``leg_counting``, ...)."""
    weight: float = Field(1.0, gt=0)
    """Its share of the mix (relative to the others' weights)."""
    config: dict[str, Any] = {}
    """Its generator's settings (``min_digits: 2``): the fields of its config class in reasoning-gym."""


class ReasoningGymTaskConfig(TaskSection):
    name: Literal["reasoning_gym"] = "reasoning_gym"
    """Task type. ``reasoning_gym``: procedural problems of the ``reasoning-gym`` package, scored by
    its own ``score_answer`` (``pip install 'tba[reasoning-gym]'``)."""
    datasets: list[ReasoningGymDataset] = Field(min_length=1)
    """The datasets to draw problems from, with their weights and settings; a bare name stands for
    ``{name: ..., weight: 1}``. Rewards and evaluation are also reported per dataset."""
    size: int = Field(1000, ge=1)
    """Training problems, generated from ``seed``."""
    seed: int = 1234
    """Seed of the training problems (independent of ``run.seed``, so runs share them)."""
    eval_size: int = Field(100, ge=1)
    """Held-out problems, generated from ``eval_seed``; training never draws one of their prompts."""
    eval_seed: int | None = None
    """Seed of the held-out problems; default ``seed + 1,000,000``. reasoning-gym draws problem ``i``
    of a generator from ``seed + i`` (and a mix's generators from the next seeds), so the seeds'
    ranges must not overlap: nearby seeds give the same problems, shifted."""
    template: str = "{question}"
    """The prompt: ``{question}``, or a format string over the problem's metadata (``{expression}=``)."""
    system_prompt: str | None = None
    """A system message before each problem: the name of one of reasoning-gym's ``SYSTEM_PROMPTS``
    (``default``, ``direct``, ``simple``, ...) or the text itself. Default: none (the problem alone,
    through ``model.chat_template``)."""
    answer_format: Literal["tags", "last_number", "text"] = "tags"
    """How the answer is read from a completion: ``tags``, the last ``<answer>...</answer>`` (what
    reasoning-gym's system prompts ask for; none found scores 0); ``last_number``, the last number as
    written (commas removed; for numeric problems and models that answer in a sentence); or
    ``text``, the whole completion."""
    max_prompt_tokens: int | None = Field(1024, ge=1)
    """Prompts longer than this many tokens are dropped at load and counted; None keeps every prompt."""

    @model_validator(mode="before")
    @classmethod
    def _bare_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("datasets"), list | str):
            found = [data["datasets"]] if isinstance(data["datasets"], str) else data["datasets"]
            data = {**data, "datasets": [{"name": d} if isinstance(d, str) else d for d in found]}
        return data

    @model_validator(mode="after")
    def _check_mix(self) -> ReasoningGymTaskConfig:
        names = [d.name for d in self.datasets]
        if len(set(names)) < len(names):
            raise ValueError(
                f"datasets: {sorted({n for n in names if names.count(n) > 1})} listed twice; list each once"
            )
        n = len(self.datasets) + 1
        train, held = (
            (self.seed, self.seed + self.size + n),
            (self.held_out_seed, self.held_out_seed + self.eval_size + n),
        )
        if train[0] < held[1] and held[0] < train[1]:
            raise ValueError(
                f"eval_seed {self.held_out_seed}: reasoning-gym seeds problem i with seed + i, so the held-out "
                f"problems (seeds {held[0]}-{held[1]}) would repeat training ones (seeds {train[0]}-{train[1]}); "
                "leave eval_seed unset or move it out of that range"
            )
        return self

    @property
    def held_out_seed(self) -> int:
        """The held-out problems' seed (``eval_seed``, default ``seed + 1,000,000``)."""
        return self.seed + 1_000_000 if self.eval_seed is None else self.eval_seed


class VerifiersTaskConfig(TaskSection):
    name: Literal["verifiers"] = "verifiers"
    """Task type. ``verifiers``: an environment of the ``verifiers`` library (Prime Intellect's
    Environments Hub), its rollouts run against the searcher's OpenAI-compatible endpoint and scored
    by its rubric (``pip install 'tba[verifiers]'``)."""
    env: str
    """The environment: an installed environment's id (what ``vf.load_environment`` takes, e.g.
    ``vf-gsm8k``), or ``module:function`` / ``path/to/file.py:function`` returning one."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of the environment's ``load_environment``."""
    eval_size: int = Field(100, ge=1)
    """Rows held out of the environment's dataset for evaluation, when it has no evaluation dataset
    of its own."""
    seed: int = 1234
    """Which rows are held out (with ``eval_size``)."""
    max_rows: int | None = Field(None, ge=1)
    """Train on the first rows of the environment's dataset only."""
    max_prompt_tokens: int | None = Field(2048, ge=1)
    """Prompts longer than this many tokens are dropped at load and counted; None keeps every prompt."""
    id_column: str | None = None
    """A column whose value identifies a row's prompt; default: a hash of the prompt."""
    max_turns: int = Field(16, ge=1)
    """Replies of the model per rollout: the endpoint refuses one more (the rollout is unfinished).
    Set it to at least the environment's own ``max_turns``, which ends its rollouts itself."""

    @model_validator(mode="after")
    def _alone(self) -> VerifiersTaskConfig:
        if self.tools or self.environment or self.agent:
            raise ValueError(
                "task.name=verifiers with task.tools, task.environment or task.agent: the verifiers environment "
                "drives its rollouts (its tools included); leave them unset"
            )
        return self

    @property
    def multi_turn(self) -> bool:
        return True

    @property
    def conversation_source(self) -> str:
        """The environment's own rollouts, through the endpoint (:mod:`tba.conversations`)."""
        return "verifiers"
