"""The built-in tools: `calculate` (arithmetic), `python` (code in a sandboxed subprocess) and `draw_dots` (an image
of dots as the built-in visual task draws them, for a vision-language model)."""

from __future__ import annotations

import ast
import operator

from PIL import Image

from ketch.data.builtin.dots import COLOURS, DotsTask, render
from ketch.rollout.multi_turn.code_tool import run_python
from ketch.rollout.multi_turn.tools import register_tool

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 64


@register_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "37*58".
    """
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"cannot read the expression {expression!r}: {exc.msg}") from None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.dump(node)[:60]}")


@register_tool
def draw_dots(count: int, colour: str = "red") -> Image.Image:
    """Draw an image of dots of one colour, in the first cells of the built-in visual task's grid.

    Args:
        count: how many dots, 0 to 16.
        colour: red, green or blue.
    """
    task = DotsTask()
    if not isinstance(count, int) or not 0 <= count <= task.cells**2:
        raise ValueError(f"count must be a whole number from 0 to {task.cells**2}, not {count!r}")
    if colour not in COLOURS:
        raise ValueError(f"colour must be one of {', '.join(COLOURS)}, not {colour!r}")
    return render(tuple((cell, colour, 0, 0) for cell in range(count)), task)


register_tool(run_python)
