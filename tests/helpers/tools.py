"""Tools as plain Python functions, with type hints and docstrings, for the tool-calling tests."""

from __future__ import annotations

import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def lookup(key: str) -> dict:
    """A record by its key.

    Args:
        key: which record
    """
    return {"key": key, "value": len(key)}


def slow(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: how long to wait
    """
    time.sleep(seconds)
    return "done"
