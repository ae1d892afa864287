"""Your own task: prompts from a dataset, rewards from your functions (``task.name: dataset``).

The prompt column holds a string or a list of chat messages; every other column reaches the
reward functions by name, in TRL's convention (``tba.rewards``). verl-style parquet files load
unchanged: their message-list ``prompt``, and ``reward_model.ground_truth`` offered as
``ground_truth``; ``task.reward_style: verl`` calls a verl ``compute_score`` per sample.

Evaluation scores greedy completions of the evaluation split with the same reward functions and
logs their mean as ``eval/reward``; with ``task.success_threshold`` a reward at or above it is a
success, which is what pass@k and maj@k count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tba.rewards import RewardFn, load_reward_functions, make_reward_fn
from tba.tasks.data import DatasetLoadError, DataTask
from tba.user_code import load_object


class DatasetTask(DataTask):
    name = "dataset"
    eval_metric = "reward"

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None):
        self._fns = (
            load_reward_functions(
                cfg.reward_funcs,
                cfg.reward_weights,
                cfg.reward_kwargs,
                style=cfg.reward_style,
                base_dir=Path(base_dir) if base_dir else None,
            )
            if cfg.reward_funcs
            else []
        )
        self.success_scores = cfg.success_threshold is not None
        self._answer = (
            load_object(cfg.answer_func, "task.answer_func", DatasetLoadError, base_dir) if cfg.answer_func else None
        )
        self.answer_errors = 0  # completions on which task.answer_func raised
        self._scorer = None  # the reward model, loaded by setup() in searcher and evaluation processes
        super().__init__(cfg, tokenizer, chat_template, log)

    def check_columns(self, columns: dict[str, list], where: str) -> None:
        for needed, key in ((self.cfg.prompt_column, "prompt_column"), (self.cfg.id_column, "id_column")):
            if needed is not None and needed not in columns:
                raise DatasetLoadError(
                    f"{where} has no column {needed!r} (task.{key}); its columns are: {', '.join(columns)}"
                )

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        return columns[self.cfg.prompt_column][i]

    def answer_of(self, row: dict[str, Any]) -> str | None:
        col = self.cfg.answer_column
        if col is None:
            return None
        value = row.get(col)
        return None if value is None else str(value)

    def setup(self, device=None) -> None:
        c = self.cfg
        if c.reward_model and self._scorer is None:
            from tba.tasks.reward_model import SequenceScorer

            self._scorer = SequenceScorer(
                c.reward_model, device or "cpu", c.reward_model_tokenizer, c.reward_batch_size, c.reward_max_length
            )

    def reward_functions(self) -> list[RewardFn]:
        if self._scorer is None:
            if self.cfg.reward_model:  # a run must never train on the functions alone by mistake
                raise RuntimeError("task.reward_model is not loaded: Task.setup() runs in searcher processes first")
            return self._fns
        return [*self._fns, make_reward_fn("reward_model", self._reward_model, self.cfg.reward_model_weight)]

    def checkable_reward_functions(self) -> list[RewardFn]:
        return self._fns  # the reward model is checked when it loads

    def _reward_model(self, prompts, completions, completion_ids, **_) -> list[float]:
        """prompt + completion as text; chat prompts through the reward model's own chat template."""
        tok = self._scorer.tokenizer
        texts = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):  # messages: the completion is [{"role": "assistant", ...}]
                if tok.chat_template:
                    texts.append(tok.apply_chat_template(p + c, tokenize=False))
                else:
                    texts.append("\n".join(str(m["content"]) for m in p + c))
            else:
                texts.append(p + c)
        return self._scorer.score(texts)

    def answer_key(self, completion: str) -> str | None:
        if self._answer is None:
            return super().answer_key(completion)
        try:
            key = self._answer(completion)
        except Exception as e:  # one completion's problem: no answer, said once, never a crash
            self.answer_errors += 1
            if self.answer_errors == 1:
                self.log(f"task.answer_func raised on a completion ({type(e).__name__}: {e}); it counts as no answer")
            return None
        return None if key is None else str(key)

    def is_success(self, score: float) -> bool:
        threshold = self.cfg.success_threshold
        return threshold is not None and score >= threshold
