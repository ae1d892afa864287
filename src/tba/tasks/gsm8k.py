"""GSM8K grade-school math (``task.name: gsm8k``), as in the TBA paper.

Prompts are ``openai/gsm8k`` questions in the paper's template (``[MATH TASK] Problem:\\n{question}
\\n\\nSolution:\\n``); the reference is the number after ``####`` in the ``answer`` column. The
reward is 1 when the completion's answer equals it, else 0, graded by the paper's rule (the last
number in the text, commas removed, compared as floats; ``tba.grading``) or by ``math-verify``.
Evaluation is greedy accuracy on the test split (``eval.limit`` cuts it); ``eval.samples`` adds
pass@k and maj@k, voting on the graded answers.

The template, the columns and the grader are configurable, so a local file in GSM8K's schema, or
another dataset of word problems with numeric answers, works the same way.
"""

from __future__ import annotations

from typing import Any

from tba.grading import answer_key, get_grader, gsm8k_reference
from tba.rewards import RewardFn, make_reward_fn
from tba.tasks.data import DatasetLoadError, DataTask


class GSM8KTask(DataTask):
    name = "gsm8k"
    eval_metric = "accuracy"

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None):
        self._grade = get_grader(cfg.grader)
        super().__init__(cfg, tokenizer, chat_template, log)

    def check_columns(self, columns: dict[str, list], where: str) -> None:
        for col in (self.cfg.question_column, self.cfg.answer_column):
            if col not in columns:
                raise DatasetLoadError(
                    f"{where} has no column {col!r}; GSM8K rows need task.question_column and task.answer_column "
                    f"(its columns are: {', '.join(columns)})"
                )

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        return self.cfg.template.format(question=str(columns[self.cfg.question_column][i]).strip())

    def answer_of(self, row: dict[str, Any]) -> str | None:
        answer = str(row[self.cfg.answer_column])
        return gsm8k_reference(answer) if "####" in answer else answer.strip()

    def make_prompt(self, columns, i):
        p = super().make_prompt(columns, i)
        p.columns["reference"] = p.answer  # the graded number reaches reward functions by name
        return p

    def reward_functions(self) -> list[RewardFn]:
        return [make_reward_fn("correct", self._correct)]

    def _correct(self, prompts, completions, completion_ids, reference, **_) -> list[float]:
        return [self._grade(c, r) for c, r in zip(completions, reference, strict=True)]

    def answer_key(self, completion: str) -> str | None:
        return answer_key(completion, self.cfg.grader)
