"""A calculator tool, for the tool-use demo and as an example of a tool: a plain function with type
hints and an ``Args:`` docstring (``task.tools: [tba.tasks.calculator:calculator]``)."""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def calculator(expression: str) -> str:
    """Compute an arithmetic expression.

    Args:
        expression: numbers, parentheses and the operators + - * / // (for example "123*456")
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float):
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if abs(left) > 10**12 or abs(right) > 10**12:
            raise ValueError("numbers above 10^12 are not supported")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r} (use numbers, + - * / // and parentheses)")
