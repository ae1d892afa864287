"""The built-in demo task: integer arithmetic such as ``37+85=`` → ``122``.

Problems draw ``terms`` operands (default 2) with up to ``digits`` digits and an operator from
``operators`` between each two; chains are computed left to right. A fixed, seeded set of problems
is held out for evaluation and never sampled for training. The reward is 1 for the exact answer
(surrounding whitespace ignored) and 0 otherwise; evaluation is greedy accuracy on the held-out set.

With ``show_work`` the completion writes each step with its intermediate result,
``3+4-5+8=`` → ``3+4=7 7-5=2 2+8=10``, and the reward is 1 when the number after the last ``=``
is the answer: a task with 20-30 token completions that a tiny model learns on a CPU.
"""

from __future__ import annotations

import random

from tba.rewards import RewardFn, make_reward_fn
from tba.tasks.base import Prompt, Task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(
        self,
        digits: int = 2,
        operators: str = "+-",
        eval_size: int = 256,
        seed: int = 1234,
        terms: int = 2,
        show_work: bool = False,
    ):
        if not operators or set(operators) - set(_OPS):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {operators!r}")
        if terms < 2:
            raise ValueError(f"terms must be at least 2, got {terms}")
        self.digits = digits
        self.operators = operators
        self.terms = terms
        self.show_work = show_work
        self.max_operand = 10**digits - 1
        total = len(operators) ** (terms - 1) * (self.max_operand + 1) ** terms
        if eval_size >= total // 2:
            raise ValueError(
                f"eval_size {eval_size} leaves too few training problems out of {total}; "
                f"lower task.eval_size or raise task.digits"
            )
        rng = random.Random(seed)
        held_out: dict[tuple, None] = {}
        while len(held_out) < eval_size:
            held_out[self._draw(rng)] = None
        self._eval = [self._prompt(p) for p in held_out]
        self._held_out = set(held_out)

    def _draw(self, rng: random.Random) -> tuple:
        if self.terms == 2:  # the draws of the 2-operand task as they always were: the same splits
            return rng.randint(0, self.max_operand), rng.choice(self.operators), rng.randint(0, self.max_operand)
        problem: list = [rng.randint(0, self.max_operand)]
        for _ in range(self.terms - 1):
            problem += [rng.choice(self.operators), rng.randint(0, self.max_operand)]
        return tuple(problem)

    def _prompt(self, problem: tuple) -> Prompt:
        text = "".join(str(x) for x in problem) + "="
        value, steps = problem[0], []
        for i in range(1, len(problem), 2):
            op, b = problem[i], problem[i + 1]
            result = _OPS[op](value, b)
            steps.append(f"{value}{op}{b}={result}")
            value = result
        answer = str(value)
        columns = {"answer": answer}
        if self.show_work:
            columns["solution"] = " ".join(steps)
        return Prompt(id=text, text=text, answer=answer, columns=columns)

    def target(self, prompt: Prompt) -> str:
        """The completion a warm start learns: the worked solution with ``show_work``, else the answer."""
        return prompt.columns.get("solution", prompt.answer)

    @property
    def max_answer_tokens(self) -> int:
        """An upper bound on the characters (tokens, for the demo's tokenizer) of a correct completion."""
        value = len(str(self.terms * self.max_operand)) + 1  # a sign and the largest chain value (+, -)
        if "*" in self.operators:
            value = len(str(self.max_operand**self.terms)) + 1
        if not self.show_work:
            return value
        return (self.terms - 1) * (value + 1 + self.digits + 1 + value + 1)

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            problem = self._draw(rng)
            if problem not in self._held_out:
                out.append(self._prompt(problem))
        return out

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1 for the exact answer (surrounding whitespace ignored), else 0; with ``show_work``, for the
        exact answer after the last ``=``."""
        text = completion.strip()
        if self.show_work:
            text = text.rpartition("=")[2].strip() if "=" in text else ""
        return 1.0 if text == prompt.answer else 0.0

    def reward_functions(self) -> list[RewardFn]:
        return [make_reward_fn("exact_match", self._exact_match)]

    def _exact_match(self, prompts, completions, completion_ids, answer, **_) -> list[float]:
        triples = zip(prompts, completions, answer, strict=True)
        return [self.reward(Prompt(id=p, text=p, answer=a), c) for p, c, a in triples]
