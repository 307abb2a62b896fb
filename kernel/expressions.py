"""The safe edge-expression grammar of fixed workflows (ADR-0073 D3) and its edge condition.

Owns parsing authored condition text into a validated syntax tree, walking that tree
against ``{"result", "context"}``, and ``ExpressionCondition``. It must never hand the
text to ``eval``, ``exec`` or ``compile``: ``ast.parse`` is the only parser used.

The grammar, and the decisions the ADR leaves open:

* comparisons ``== != < <= > >= in not in`` (chained, conventionally); ``is``/``is not``
  are rejected: identity means nothing for values that crossed the wire, use ``== None``;
* ``and``/``or`` short-circuit with Python semantics (they return an operand, not a
  bool); ``not`` returns a bool; ``ExpressionCondition`` takes ``bool()`` of the whole;
* literals: ``str``, ``int``, ``float``, ``bool``, ``None``; a minus sign directly on a
  numeric literal (``-1``, ``-0.5``) is part of the literal; ``-x``, ``+1``, ``--1``,
  bytes, complex numbers and ``...`` are rejected;
* list and tuple displays whose items are themselves allowed expressions;
  set and dict displays, starred items, slices and ``a if b else c`` are rejected;
* names and attributes not starting with ``_``; subscripts with an allowed index
  expression (negative indexes count from the end, as in Python);
* no arithmetic or bitwise operators, calls, lambdas, comprehensions, f-strings, walrus.

Budgets: at most ``MAX_EXPRESSION_LENGTH`` characters, checked before parsing, and at
most ``MAX_AST_DEPTH`` expression nodes on any root-to-leaf path of the tree (operator
and context nodes such as ``Eq`` or ``Load`` do not count, and a negative literal is one
node): ``x`` has depth 1 and ``result.score > 0.5`` depth 3.

Evaluation never calls a method of the data by name. A dotted name or a subscript
resolves, in order: a key of a mapping; an item of a list, tuple or string; a declared
field of a pydantic model; an entry of ``vars(obj)`` (instance attributes of a plain
object). Properties, methods and class attributes are never reached. Anything missing
(key, index, attribute, or a value that has none of these shapes) resolves to ``None``;
a missing *top-level* name raises ``UnsafeExpressionError``. A comparison that Python
refuses with ``TypeError`` (``None < 3``, ``1 in 5``) is ``False`` -- including
``not in`` -- so an ill-typed condition never opens an edge. Errors other than those
raised by a value's own methods (a custom ``__eq__`` raising, say) are not swallowed:
they propagate, and the scheduler settles the gated node as failed.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from .codec import register_condition
from .errors import CodecError, OperationError
from .graph import EdgeCondition

__all__ = [
    "CONDITION_NAMES",
    "CompiledExpression",
    "ExpressionCondition",
    "MAX_AST_DEPTH",
    "MAX_EXPRESSION_LENGTH",
    "UnsafeExpressionError",
    "parse_expression",
]

MAX_EXPRESSION_LENGTH = 1000
MAX_AST_DEPTH = 20

# The only top-level names an edge condition sees (ADR-0073 D3).
CONDITION_NAMES: frozenset[str] = frozenset({"result", "context"})

_ALLOWED = (
    "comparisons (== != < <= > >= in, not in), and/or/not, str/int/float/bool/None "
    "literals, list and tuple displays, names, non-private attribute and subscript access"
)


class UnsafeExpressionError(OperationError):
    """An edge expression is outside the safe grammar, over budget, or names a missing variable.

    Carries ``edge_id`` when the caller knows which edge the text belongs to; the
    workflow compiler translates it into its own node/edge-addressed compile error.
    """


# -- parsing and validation ------------------------------------------------------------
_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda left, right: operator.contains(right, left),
    ast.NotIn: lambda left, right: not operator.contains(right, left),
}
_LITERAL_TYPES = (str, int, float, bool, type(None))

# A readable name for each rejected construct, so the error says what was found.
_REJECTED_NAMES: dict[type[ast.AST], str] = {
    ast.Call: "a call",
    ast.Lambda: "a lambda",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a generator expression",
    ast.JoinedStr: "an f-string",
    ast.FormattedValue: "an f-string",
    ast.NamedExpr: "an assignment expression (:=)",
    ast.Starred: "a starred item",
    ast.Slice: "a slice",
    ast.Set: "a set display",
    ast.Dict: "a dict display",
    ast.IfExp: "a conditional expression (a if b else c)",
    ast.BinOp: "an arithmetic or bitwise operator",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
}


def parse_expression(
    text: str,
    *,
    edge_id: str | None = None,
    names: Collection[str] | None = None,
) -> CompiledExpression:
    """Parse and validate ``text`` against the safe grammar.

    ``names``, when given, is the closed set of top-level names the expression may
    use; any other name is rejected here rather than at evaluation. Every failure --
    bad syntax, a disallowed construct, a budget, a parser exhausting its own
    limits -- is an ``UnsafeExpressionError`` carrying ``edge_id``.
    """
    if not isinstance(text, str):
        raise UnsafeExpressionError(
            f"an edge expression must be a string, got {type(text).__name__}", edge_id=edge_id
        )
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise UnsafeExpressionError(
            f"edge expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_LENGTH}. "
            "Move the logic into an operation and gate on its result",
            edge_id=edge_id,
        )
    try:
        # Leading whitespace is an IndentationError in eval mode; authored JSON often has it.
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        # SyntaxError covers null bytes (3.12+) and "too many nested parentheses";
        # ValueError covers null bytes (3.11); RecursionError/MemoryError come from the
        # parser's own depth limits on pathological nesting.
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise UnsafeExpressionError(
            f"edge expression is not valid expression syntax ({detail}); allowed: {_ALLOWED}",
            edge_id=edge_id,
        ) from exc
    allowed_names = None if names is None else frozenset(names)
    body = _validate(tree.body, 1, edge_id, allowed_names)
    return CompiledExpression(text, body, edge_id=edge_id, names=allowed_names)


def _reject(node: ast.AST, what: str, edge_id: str | None) -> UnsafeExpressionError:
    where = f" at column {node.col_offset + 1}" if hasattr(node, "col_offset") else ""
    return UnsafeExpressionError(
        f"edge expression uses {what}{where}; allowed: {_ALLOWED}", edge_id=edge_id
    )


def _validate(node: ast.AST, depth: int, edge_id: str | None, names: frozenset[str] | None) -> ast.AST:
    """Check ``node`` and its children; return it, with ``-<number>`` folded to a literal.

    The depth check comes first, so this recursion is bounded by ``MAX_AST_DEPTH``
    whatever the parser produced.
    """
    return _Grammar(edge_id, names).check(node, depth)


@dataclass(frozen=True, slots=True)
class _Grammar:
    """The expression grammar as checks, one method per kind of node it allows.

    ``check`` bounds the depth and hands a node to the method for its type; a type
    without one is refused. Each method checks its node, checks its children one level
    deeper, and returns the node to keep.
    """

    edge_id: str | None
    names: frozenset[str] | None  # the top-level names an expression may read; None: any

    def check(self, node: ast.AST, depth: int) -> ast.AST:
        if depth > MAX_AST_DEPTH:
            raise UnsafeExpressionError(
                f"edge expression nests deeper than {MAX_AST_DEPTH} levels; simplify it", edge_id=self.edge_id
            )
        method = _GRAMMAR.get(type(node))
        if method is None:
            what = _REJECTED_NAMES.get(type(node), f"the construct {type(node).__name__}")
            raise _reject(node, what, self.edge_id)
        return method(self, node, depth + 1)

    def constant(self, node: ast.Constant, child: int) -> ast.AST:
        """A literal of an allowed type."""
        value = node.value
        if not isinstance(value, _LITERAL_TYPES):
            raise _reject(node, f"a {type(value).__name__} literal", self.edge_id)
        return node

    def name(self, node: ast.Name, child: int) -> ast.AST:
        """A public name, one of ``names`` if they are given."""
        _check_load(node, self.edge_id)
        if node.id.startswith("_"):
            raise _reject(node, f"the private name {node.id!r}", self.edge_id)
        if self.names is not None and node.id not in self.names:
            raise UnsafeExpressionError(
                f"edge expression uses the unknown name {node.id!r}; "
                f"available names: {', '.join(sorted(self.names))}",
                edge_id=self.edge_id,
            )
        return node

    def attribute(self, node: ast.Attribute, child: int) -> ast.AST:
        """A public attribute of an allowed value."""
        _check_load(node, self.edge_id)
        if node.attr.startswith("_"):
            raise _reject(node, f"the private attribute {node.attr!r}", self.edge_id)
        node.value = self.check(node.value, child)
        return node

    def subscript(self, node: ast.Subscript, child: int) -> ast.AST:
        """An allowed value subscripted by an allowed value."""
        _check_load(node, self.edge_id)
        node.value = self.check(node.value, child)
        node.slice = self.check(node.slice, child)
        return node

    def compare(self, node: ast.Compare, child: int) -> ast.AST:
        """A comparison whose every operator is an allowed one."""
        for op in node.ops:
            if type(op) not in _COMPARISONS:
                raise _reject(node, f"the operator {type(op).__name__!r} (use == or !=)", self.edge_id)
        node.left = self.check(node.left, child)
        node.comparators = [self.check(item, child) for item in node.comparators]
        return node

    def bool_op(self, node: ast.BoolOp, child: int) -> ast.AST:
        """``and`` / ``or`` of allowed values."""
        node.values = [self.check(item, child) for item in node.values]
        return node

    def unary_op(self, node: ast.UnaryOp, child: int) -> ast.AST:
        """``not`` of an allowed value, or a negative number literal, folded to a Constant."""
        if isinstance(node.op, ast.Not):
            node.operand = self.check(node.operand, child)
            return node
        operand = node.operand
        if (
            isinstance(node.op, ast.USub)
            and isinstance(operand, ast.Constant)
            and isinstance(operand.value, (int, float))
            and not isinstance(operand.value, bool)
        ):
            # A negative number literal: fold it, so evaluation only ever sees Constants.
            return ast.copy_location(ast.Constant(-operand.value), node)
        raise _reject(node, "an arithmetic sign (only a literal negative number is allowed)", self.edge_id)

    def sequence(self, node: ast.List | ast.Tuple, child: int) -> ast.AST:
        """A list or tuple display of allowed values."""
        _check_load(node, self.edge_id)
        node.elts = [self.check(item, child) for item in node.elts]
        return node


# Node type -> the _Grammar method that checks it. Exact types: ast.parse makes nothing else.
_GRAMMAR: dict[type, Callable[[_Grammar, Any, int], ast.AST]] = {
    ast.Constant: _Grammar.constant,
    ast.Name: _Grammar.name,
    ast.Attribute: _Grammar.attribute,
    ast.Subscript: _Grammar.subscript,
    ast.Compare: _Grammar.compare,
    ast.BoolOp: _Grammar.bool_op,
    ast.UnaryOp: _Grammar.unary_op,
    ast.List: _Grammar.sequence,
    ast.Tuple: _Grammar.sequence,
}


_Loadable = ast.Name | ast.Attribute | ast.Subscript | ast.List | ast.Tuple


def _check_load(node: _Loadable, edge_id: str | None) -> None:
    # In eval mode every context is Load; checked anyway so a tree built elsewhere can't slip by.
    if not isinstance(node.ctx, ast.Load):
        raise _reject(node, "an assignment or deletion target", edge_id)


# -- evaluation ------------------------------------------------------------------------
class CompiledExpression:
    """A validated expression tree; ``evaluate`` walks it, never ``eval``.

    Built only by ``parse_expression``. Pickles as its source text and re-validates
    on load, so a pickled tree can never carry nodes the validator did not see.
    """

    __slots__ = ("_body", "edge_id", "names", "text")

    #: The expression's source: what it pickles as, re-validated on load.
    text: str
    #: The edge it gates, for the errors it raises; None outside an edge.
    edge_id: str | None
    #: The top-level names it may read; None: any name.
    names: frozenset[str] | None
    #: The validated tree that ``evaluate`` walks. Set once by __init__, as every slot is.
    _body: ast.AST

    def __init__(
        self,
        text: str,
        body: ast.AST,
        *,
        edge_id: str | None = None,
        names: frozenset[str] | None = None,
    ) -> None:
        self.text = text
        self.edge_id = edge_id
        self.names = names
        self._body = body

    def evaluate(self, variables: Mapping[str, Any]) -> Any:
        """The expression's value with top-level names taken from ``variables``."""
        return self._eval(self._body, variables)

    def _eval(self, node: ast.AST, variables: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in variables:
                raise UnsafeExpressionError(
                    f"edge expression names {node.id!r}, which is not defined; "
                    f"available names: {', '.join(sorted(map(str, variables)))}",
                    edge_id=self.edge_id,
                )
            return variables[node.id]
        if isinstance(node, ast.Attribute):
            return _member(self._eval(node.value, variables), node.attr)
        if isinstance(node, ast.Subscript):
            return _member(self._eval(node.value, variables), self._eval(node.slice, variables))
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, variables)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                right = self._eval(comparator, variables)
                if not _compare(_COMPARISONS[type(op)], left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BoolOp):
            stop_when = isinstance(node.op, ast.Or)  # `or` stops at a truthy value, `and` at a falsy one
            value: Any = None
            for item in node.values:
                value = self._eval(item, variables)
                if bool(value) is stop_when:
                    return value
            return value
        if isinstance(node, ast.UnaryOp):  # only `not` survives validation
            return not self._eval(node.operand, variables)
        if isinstance(node, ast.List):
            return [self._eval(item, variables) for item in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(self._eval(item, variables) for item in node.elts)
        # Unreachable for a tree built by parse_expression.
        raise UnsafeExpressionError(
            f"edge expression holds an unvalidated {type(node).__name__} node", edge_id=self.edge_id
        )

    def __reduce__(self):
        return (_reparse, (self.text, self.edge_id, self.names))

    def __repr__(self) -> str:
        return f"CompiledExpression({self.text!r})"


def _reparse(text: str, edge_id: str | None, names: frozenset[str] | None) -> CompiledExpression:
    return parse_expression(text, edge_id=edge_id, names=names)


def _compare(compare: Callable[[Any, Any], Any], left: Any, right: Any) -> bool:
    try:
        return bool(compare(left, right))
    except TypeError:
        # An ill-typed comparison (None < 3, 1 in 5, [1] in "abc") never opens an edge.
        return False


def _member(value: Any, key: Any) -> Any:
    """``value.key`` / ``value[key]`` on plain data only; anything missing is ``None``."""
    try:
        if isinstance(value, dict):
            # dict.get, not value[key]: a defaultdict must not grow a key by being read.
            return dict.get(value, key)
        if isinstance(value, Mapping):
            return value.get(key)
        if isinstance(value, (list, tuple, str)):
            if isinstance(key, int):
                return value[key]
            return None
    except (KeyError, IndexError, TypeError):
        # TypeError: an unhashable key (a list used as a dict key).
        return None
    if not isinstance(key, str) or key.startswith("_"):
        return None
    if isinstance(value, (type, ModuleType)) or callable(value):
        # Classes, modules and functions are code, not data: vars() would expose their namespace.
        return None
    if isinstance(value, BaseModel):
        # Declared fields only: pydantic keeps their values in the instance __dict__.
        return value.__dict__.get(key) if key in type(value).model_fields else None
    try:
        attributes = vars(value)
    except TypeError:  # no instance __dict__ (ints, None, slotted objects)
        return None
    return attributes.get(key)


# -- the edge condition ------------------------------------------------------------------
class ExpressionCondition(EdgeCondition):
    """Gate an edge on a safe expression over ``result`` and ``context`` (ADR-0073 D3).

    The text is parsed at construction, so an unsafe or malformed expression -- or one
    naming anything but ``result`` and ``context`` -- fails before the graph runs.
    ``apply`` is synchronous, so the scheduler evaluates it in place.
    """

    #: The compiled expression ``apply`` evaluates. Set once by __init__, as every attribute is.
    _compiled: CompiledExpression
    #: The expression's text: what the condition equals, hashes, pickles and travels as.
    expression: str
    #: The edge it gates, for the errors its expression raises.
    edge_id: str | None

    def __init__(self, expression: str, *, edge_id: str | None = None) -> None:
        self._compiled = parse_expression(expression, edge_id=edge_id, names=CONDITION_NAMES)
        self.expression = expression
        self.edge_id = edge_id

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        variables = {"result": input["result"], "context": input["context"]}
        return bool(self._compiled.evaluate(variables))

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "expression", "expression": self.expression}

    @classmethod
    def from_wire(cls, payload: Mapping[str, Any]) -> ExpressionCondition:
        """Decode ``to_wire`` output; a malformed or unsafe payload is a ``CodecError``."""
        expression = payload.get("expression")
        if not isinstance(expression, str):
            raise CodecError(f"an expression condition needs a string 'expression', got {expression!r}")
        try:
            return cls(expression)
        except UnsafeExpressionError as exc:
            raise CodecError(f"wire expression condition is not safe: {exc.message}") from exc

    def __reduce__(self):
        return (_rebuild_condition, (self.expression, self.edge_id))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpressionCondition):
            return NotImplemented
        return self.expression == other.expression

    def __hash__(self) -> int:
        return hash((ExpressionCondition, self.expression))

    def __repr__(self) -> str:
        return f"ExpressionCondition({self.expression!r})"


def _rebuild_condition(expression: str, edge_id: str | None) -> ExpressionCondition:
    return ExpressionCondition(expression, edge_id=edge_id)


register_condition("expression", ExpressionCondition.from_wire)
