"""Slow stand-ins for tools, for benchmarks: the same function names and answers as the real tools,
after a delay (a sandbox, a search engine, a remote service). ``task.tools:
[tba.tasks.slow_tools:calculator]`` is the calculator, 0.2 s a call."""

from __future__ import annotations

import time

from tba.tasks import calculator as _calculator

DELAY_S = 0.2


def calculator(expression: str) -> str:
    """Compute an arithmetic expression.

    Args:
        expression: numbers, parentheses and the operators + - * / // (for example "123*456")
    """
    time.sleep(DELAY_S)
    return _calculator.calculator(expression)
