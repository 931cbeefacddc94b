"""Arithmetic expressions of compiled-source family files (constraints, grids, sizes).

`BN * NW <= 512`, `ceil_div(q_len * heads, 16)`, `0 if PIPE == 0 else 2 * BN * 576`: parsed
with Python's own parser, then checked against a short list of node kinds (numbers, names,
arithmetic, comparisons, `and`/`or`/`not`, `x if c else y`, and calls of `min`, `max`,
`ceil_div`), so a family file can never run code. Names are checked when the file loads.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class ExprError(ValueError):
    """An expression that is not allowed or cannot be evaluated."""


def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


_FUNCS: dict[str, Callable[..., int | float]] = {"min": min, "max": max, "ceil_div": _ceil_div}
_BIN: dict[type, Callable[[object, object], object]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Mod: operator.mod}
_CMP: dict[type, Callable[[object, object], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne}


@dataclass(frozen=True)
class Expr:
    """A parsed, checked expression and the names it reads."""

    text: str
    tree: ast.expression
    names: frozenset[str]

    def __call__(self, env: Mapping[str, int | float | str | bool]) -> int | float | bool:
        try:
            return _eval(self.tree.body, env)
        except ZeroDivisionError:
            raise ExprError(f"{self.text!r}: division by zero") from None


def parse(text: object, where: str) -> Expr:
    """Parse `text` (or a bare number) into an Expr; `where` names it in errors."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ExprError(f"{where}: expected an expression string or integer, got {text!r}")
    src = str(text)
    try:
        tree = ast.parse(f"(\n{src}\n)", mode="eval")  # parenthesized: may span lines
    except SyntaxError as e:
        raise ExprError(f"{where}: {src!r} is not an expression ({e.msg})") from None
    names: set[str] = set()
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS or node.keywords:
                raise ExprError(f"{where}: {src!r}: only {', '.join(_FUNCS)} may be called")
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float, str)):
                raise ExprError(f"{where}: {src!r}: constant {node.value!r} not allowed")
        elif not isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp,
                                   ast.Load, ast.USub, ast.UAdd, ast.Not, ast.And, ast.Or,
                                   *_BIN, *_CMP)):
            raise ExprError(f"{where}: {src!r}: {type(node).__name__} is not allowed "
                            "(arithmetic, comparisons, and/or/not, x if c else y, "
                            "min/max/ceil_div only)")
    names -= set(_FUNCS)
    return Expr(src, tree, frozenset(names))


def _eval(node: ast.AST, env: Mapping[str, int | float | str | bool]) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"unknown name {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _BIN[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env)
        return (not v) if isinstance(node.op, ast.Not) else (-v if isinstance(node.op, ast.USub)
                                                             else +v)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(v, env) for v in node.values)
        return any(_eval(v, env) for v in node.values)
    if isinstance(node, ast.IfExp):
        return _eval(node.body, env) if _eval(node.test, env) else _eval(node.orelse, env)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return _FUNCS[node.func.id](*(_eval(a, env) for a in node.args))
    raise ExprError(f"cannot evaluate {type(node).__name__}")


__all__ = ["Expr", "ExprError", "parse"]
