"""The built-in demo task: integer arithmetic such as ``37+85=`` → ``122``.

Problems draw two operands with up to ``digits`` digits and an operator from ``operators``. A
fixed, seeded set of problems is held out for evaluation and never sampled for training. The
reward is 1 for the exact answer (surrounding whitespace ignored) and 0 otherwise; evaluation is
greedy accuracy on the held-out set.
"""

from __future__ import annotations

import random

from tba.rewards import RewardFn, make_reward_fn
from tba.tasks.base import Prompt, Task

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, digits: int = 2, operators: str = "+-", eval_size: int = 256, seed: int = 1234):
        if not operators or set(operators) - set(_OPS):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {operators!r}")
        self.digits = digits
        self.operators = operators
        self.max_operand = 10**digits - 1
        total = len(operators) * (self.max_operand + 1) ** 2
        if eval_size >= total // 2:
            raise ValueError(
                f"eval_size {eval_size} leaves too few training problems out of {total}; "
                f"lower task.eval_size or raise task.digits"
            )
        rng = random.Random(seed)
        held_out: dict[tuple[int, str, int], None] = {}
        while len(held_out) < eval_size:
            held_out[self._draw(rng)] = None
        self._eval = [self._prompt(*p) for p in held_out]
        self._held_out = set(held_out)

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(0, self.max_operand), rng.choice(self.operators), rng.randint(0, self.max_operand)

    @staticmethod
    def _prompt(a: int, op: str, b: int) -> Prompt:
        text = f"{a}{op}{b}="
        answer = str(_OPS[op](a, b))
        return Prompt(id=text, text=text, answer=answer, columns={"answer": answer})

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            problem = self._draw(rng)
            if problem not in self._held_out:
                out.append(self._prompt(*problem))
        return out

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1 for the exact answer (surrounding whitespace ignored), else 0."""
        return 1.0 if completion.strip() == prompt.answer else 0.0

    def reward_functions(self) -> list[RewardFn]:
        return [make_reward_fn("exact_match", self._exact_match)]

    def _exact_match(self, prompts, completions, completion_ids, answer, **_) -> list[float]:
        triples = zip(prompts, completions, answer, strict=True)
        return [self.reward(Prompt(id=p, text=p, answer=a), c) for p, c, a in triples]
