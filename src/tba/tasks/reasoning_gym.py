"""Procedural problems of the ``reasoning-gym`` package (``task.name: reasoning_gym``).

``task.datasets`` names one or more of its generators with their weights and settings; ``size``
training problems come from ``seed`` and ``eval_size`` held-out ones from ``eval_seed`` (seeds far
apart; training never draws a prompt that is also held out). A prompt is the problem's question,
or ``task.template`` over its metadata, after an optional system message (``task.system_prompt``:
one of reasoning-gym's own by name, or the text). The reward of a completion is reasoning-gym's
``score_answer`` of the answer read from it (``task.answer_format``: the last ``<answer>`` tags,
or the whole text) against the problem, in [0, 1]; a score of 1 is a success (pass@k, maj@k).

Each dataset of a mix is a reward function of its own, which scores its problems and leaves the
others' to theirs: ``reward/<dataset>_mean`` follows each one in training, and evaluation logs
``eval/reward/<dataset>`` beside the mean.
"""

from __future__ import annotations

import difflib
from functools import partial
from typing import Any

from tba.config import ConfigError
from tba.grading import last_number_text
from tba.rewards import RewardFn, make_reward_fn
from tba.tasks.base import Prompt
from tba.tasks.data import DataTask, prompt_hash

INSTALL = "pip install 'tba[reasoning-gym]'"


def import_reasoning_gym():
    """The ``reasoning_gym`` package, or a :class:`ConfigError` saying how to install it."""
    try:
        import reasoning_gym
        import reasoning_gym.composite
        import reasoning_gym.utils
    except ImportError as err:
        raise ConfigError(
            f"task.name=reasoning_gym needs the reasoning-gym package ({err}); install it: {INSTALL}"
        ) from None
    return reasoning_gym


def check_datasets(rg, cfg) -> None:
    """Each of ``cfg.datasets`` known to reasoning-gym and its settings accepted by its generator,
    so that a wrong name or key is one line naming it."""
    known = rg.factory.DATASETS
    for d in cfg.datasets:
        if d.name not in known or d.name == "composite":
            near = difflib.get_close_matches(d.name, list(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(
                f"task.datasets: reasoning-gym has no dataset {d.name!r}{hint}; its {len(known)} datasets: "
                "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'"
            )
        try:  # each generator's own checks, with its name in the message
            rg.create_dataset(d.name, **{"size": 1, "seed": 0, **d.config})
        except (TypeError, ValueError, AssertionError) as err:
            fields = ", ".join(f for f in known[d.name][1].__dataclass_fields__ if f not in ("seed", "size"))
            raise ConfigError(
                f"task.datasets {d.name}: config {d.config} is refused ({type(err).__name__}: {err}); "
                f"its settings are: {fields}"
            ) from None


def build_mix(rg, cfg, size: int, seed: int):
    """reasoning-gym's composite dataset of ``cfg.datasets``: ``size`` problems from ``seed``."""
    specs = [rg.composite.DatasetSpec(name=d.name, weight=d.weight, config=dict(d.config)) for d in cfg.datasets]
    return rg.create_dataset("composite", size=size, seed=seed, datasets=specs)


class ReasoningGymTask(DataTask):
    name = "reasoning_gym"
    eval_metric = "reward"

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None):
        rg = import_reasoning_gym()
        check_datasets(rg, cfg)
        self._extract = rg.utils.extract_answer
        self._system = (
            None if cfg.system_prompt is None else rg.utils.SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)
        )
        self._train_set = build_mix(rg, cfg, cfg.size, cfg.seed)
        self._eval_set = build_mix(rg, cfg, cfg.eval_size, cfg.held_out_seed)
        self._check_template(cfg.template, self._train_set[0])
        super().__init__(cfg, tokenizer, chat_template, log)

    @staticmethod
    def _check_template(template: str, entry: dict) -> None:
        try:
            template.format(question=entry["question"], **entry["metadata"])
        except (KeyError, IndexError, ValueError) as err:
            fields = ", ".join(["question", *entry["metadata"]])
            raise ConfigError(
                f"task.template {template!r} cannot be filled ({type(err).__name__}: {err}); its fields are {fields}"
            ) from None

    # ------------------------------------------------------------ the problems as columns

    @property
    def source(self) -> str:
        return "reasoning-gym " + " + ".join(d.name for d in self.cfg.datasets)

    def load_columns(self) -> tuple[dict[str, list], list[int], dict[str, list], list[int]]:
        train, held = _columns(self._train_set), _columns(self._eval_set)
        return train, list(range(self.cfg.size)), held, list(range(self.cfg.eval_size))

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        entry = columns["entry"][i]
        text = self.cfg.template.format(question=entry["question"], **entry["metadata"])
        if self._system is None:
            return text
        return [{"role": "system", "content": self._system}, {"role": "user", "content": text}]

    def prompt_id(self, columns: dict[str, list], i: int) -> str:
        return prompt_hash(self.prompt_value(columns, i))

    def answer_of(self, row: dict[str, Any]) -> str | None:
        return str(row["answer"])

    # ------------------------------------------------------------ scores

    def answer(self, completion: str | list[dict]) -> str | None:
        """The answer a completion gives, as reasoning-gym's ``score_answer`` takes it."""
        text = completion if isinstance(completion, str) else str(completion[-1]["content"])
        if self.cfg.answer_format == "tags":
            return self._extract(text)
        if self.cfg.answer_format == "last_number":
            found = last_number_text(text)
            return None if found is None else found.rstrip(".")
        return text.strip()

    def reward_functions(self) -> list[RewardFn]:
        return [make_reward_fn(d.name, partial(self._score, d.name)) for d in self.cfg.datasets]

    def _score(self, which: str, prompts, completions, completion_ids, dataset, entry, **_) -> list[float | None]:
        """reasoning-gym's score of the completions of ``which``'s problems; None for the others'."""
        return [
            float(self._train_set.score_answer(self.answer(c), e)) if d == which else None
            for c, d, e in zip(completions, dataset, entry, strict=True)
        ]

    def answer_key(self, completion: str) -> str | None:
        return self.answer(completion) or None

    def is_success(self, score: float) -> bool:
        return score >= 1.0

    def eval_group(self, prompt: Prompt) -> str | None:
        return prompt.columns["dataset"] if len(self.cfg.datasets) > 1 else None

    def describe(self) -> str:
        mix = ", ".join(f"{d.name} (weight {d.weight:g})" for d in self.cfg.datasets)
        return f"{super().describe()}; {mix}"


def _columns(dataset) -> dict[str, list]:
    """A generated dataset as columns: the problem (``entry``, what ``score_answer`` takes), its
    reference answer and the name of the dataset it came from."""
    entries = list(dataset)
    return {
        "entry": entries,
        "answer": [e["answer"] for e in entries],
        "dataset": [e["metadata"]["source_dataset"] for e in entries],
    }
