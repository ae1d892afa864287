"""A calculator tool, for the tool-use demo and as an example of a tool: a plain function with type
hints and an ``Args:`` docstring (``task.tools: [tba.tasks.calculator:calculator]``)."""

from __future__ import annotations

import ast
import operator
import time

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calculator(expression: str) -> str:
    """Compute an integer arithmetic expression.

    Args:
        expression: digits, parentheses and the operators + - * // (for example "123*456")
    """
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def slow_calculator(expression: str) -> str:
    """Compute an integer arithmetic expression, taking 0.2 seconds (a stand-in for a slow tool:
    a sandbox, a search engine, a remote service).

    Args:
        expression: digits, parentheses and the operators + - * // (for example "123*456")
    """
    time.sleep(0.2)
    return calculator(expression)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if abs(left) > 10**12 or abs(right) > 10**12:
            raise ValueError("numbers above 10^12 are not supported")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not an integer expression: {ast.unparse(node)!r} (use digits, + - * // and parentheses)")
