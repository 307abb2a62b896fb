"""The safe edge-expression grammar (ADR-0073 D3): what it admits, what it refuses, and that
nothing else escapes.

Allowed constructs are checked by value; every refused construct by its typed error. The
Hypothesis section throws random text and grammar-shaped adversarial expressions at the
parser and evaluator with ``eval``/``exec``/``compile``/``__import__`` booby-trapped, and
asserts the only exception ever seen is ``UnsafeExpressionError``.
"""

from __future__ import annotations

import ast
import builtins
import pickle
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import opgraph.kernel.expressions as expressions
from opgraph.kernel import (
    MAX_AST_DEPTH,
    MAX_EXPRESSION_LENGTH,
    CodecError,
    ExpressionCondition,
    Graph,
    OperationError,
    UnsafeExpressionError,
    create_operation,
    decode,
    encode,
    parse_expression,
)


class Report(BaseModel):
    score: float
    tags: list[str] = []

    @property
    def computed(self) -> str:  # a property must never be reached by the evaluator
        raise AssertionError("the evaluator ran a property")


class Plain:
    klass = "class attribute, not instance data"

    def __init__(self) -> None:
        self.name = "plain"
        self._hidden = "private"

    @property
    def boom(self) -> str:
        raise AssertionError("the evaluator ran a property")

    def method(self) -> str:
        raise AssertionError("the evaluator ran a method")


VARIABLES: dict[str, Any] = {
    "result": {
        "score": 0.75,
        "status": "ok",
        "count": 3,
        "items": [10, 20, 30],
        "nested": {"deep": {"value": "x"}, "list": [{"k": 1}, {"k": 2}]},
        "none": None,
        "flag": True,
        "empty": [],
    },
    "context": {"threshold": 0.5, "allowed": ["ok", "done"], "topic": "ray"},
}


def value_of(text: str, variables: dict[str, Any] = VARIABLES) -> Any:
    return parse_expression(text).evaluate(variables)


# -- allowed constructs ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # literals
        ("1", 1),
        ("-1", -1),
        ("-2.5", -2.5),
        ("0.5", 0.5),
        ("'s'", "s"),
        ('"double"', "double"),
        ("True", True),
        ("False", False),
        ("None", None),
        ("[1, 'a', None, [True]]", [1, "a", None, [True]]),
        ("(1, 2)", (1, 2)),
        ("()", ()),
        ("[]", []),
        ("[result.count, context.topic]", [3, "ray"]),
        # names, attributes, subscripts
        ("result", VARIABLES["result"]),
        ("result.score", 0.75),
        ("result['score']", 0.75),
        ("result.nested.deep.value", "x"),
        ("result['nested']['list'][1]['k']", 2),
        ("result.nested.list[0].k", 1),
        ("result.items[-1]", 30),
        ("result.items[0]", 10),
        ("result[context.topic]", None),
        ("context.allowed[1]", "done"),
        ("'abc'[1]", "b"),
        # comparisons
        ("result.score > 0.5", True),
        ("result.score >= 0.75", True),
        ("result.score < context.threshold", False),
        ("result.score <= 0.75", True),
        ("result.status == 'ok'", True),
        ("result.status != 'ok'", False),
        ("result.status in context.allowed", True),
        ("result.status not in context.allowed", False),
        ("'a' in 'cat'", True),
        ("20 in result.items", True),
        ("'score' in result", True),
        ("result.none == None", True),
        ("result.missing != None", False),
        ("0 < result.count < 5", True),
        ("0 < result.count < 2", False),
        ("1 < 2 > 3", False),  # chained: (1 < 2) and (2 > 3)
        ("[1, 2] == [1, 2]", True),
        ("(1, 2) != (1, 2)", False),
        # boolean operators, with Python's operand-returning semantics
        ("result.flag and result.count", 3),
        ("result.empty or 'fallback'", "fallback"),
        ("result.none or result.empty", []),
        ("result.empty and result.missing.entirely", []),
        ("not result.flag", False),
        ("not result.empty", True),
        ("not not result.count", True),
        ("result.score > 0.5 and result.status in context.allowed", True),
        ("result.score > 0.9 or context.topic == 'ray'", True),
        ("(result.score > 0.9 or result.count == 3) and not result.none", True),
        # whitespace around the text is ignored
        ("  result.count == 3\n", True),
    ],
)
def test_allowed_constructs_evaluate_like_python(text, expected):
    assert value_of(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "result.missing",
        "result['missing']",
        "result.nested.deep.missing",
        "result.missing.further.still",
        "result.items[99]",
        "result.items[-99]",
        "result.items['text-index']",
        "result.items.count",  # a list method is not data
        "result.status.upper",  # neither is a str method
        "result.score.real",  # nor an attribute of a float
        "result.none.anything",
        "result[[1]]",  # an unhashable key
        "result[0]",
    ],
)
def test_a_missing_key_attribute_or_index_resolves_to_none(text):
    assert value_of(text) is None


def test_a_missing_top_level_name_raises_at_evaluation_with_the_edge_id():
    compiled = parse_expression("nobody > 1", edge_id="e7")
    with pytest.raises(UnsafeExpressionError) as caught:
        compiled.evaluate(VARIABLES)
    assert caught.value.edge_id == "e7"
    assert "nobody" in str(caught.value) and "e7" in str(caught.value)


def test_a_short_circuit_never_evaluates_the_missing_name():
    assert value_of("result.flag or nobody") is True
    assert value_of("result.none and nobody") is None
    assert value_of("1 > 2 < nobody") is False  # a chained comparison stops too


@pytest.mark.parametrize(
    "text",
    [
        "result.none < 3",
        "result.status > 1",
        "1 in result.count",
        "[1] in 'abc'",
        "result.nested < result.items",
    ],
)
def test_an_ill_typed_comparison_is_false(text):
    assert value_of(text) is False


def test_an_ill_typed_not_in_is_false_too_so_it_never_opens_an_edge():
    assert value_of("1 not in result.count") is False
    assert value_of("not (1 in result.count)") is True  # the explicit negation is honest


def test_objects_expose_fields_and_instance_attributes_but_never_properties_or_methods():
    variables = {"result": Report(score=0.9, tags=["a"]), "context": Plain()}
    assert value_of("result.score > 0.5", variables) is True
    assert value_of("result['score']", variables) == 0.9
    assert value_of("result.tags[0]", variables) == "a"
    assert value_of("result.computed", variables) is None
    assert value_of("result.model_fields", variables) is None
    assert value_of("result.model_dump", variables) is None
    assert value_of("context.name", variables) == "plain"
    assert value_of("context['name']", variables) == "plain"
    assert value_of("context.boom", variables) is None
    assert value_of("context.method", variables) is None
    assert value_of("context.klass", variables) is None
    assert value_of("context['_hidden']", variables) is None  # a private key string is refused too
    assert value_of("context.name.missing", variables) is None


def test_namespaces_that_are_code_are_opaque():
    variables = {"result": Plain, "context": {"module": builtins, "function": value_of}}
    assert value_of("result.klass", variables) is None
    assert value_of("context.module.eval", variables) is None
    assert value_of("context.function.anything", variables) is None


def test_reading_a_defaultdict_does_not_grow_it():
    grows: defaultdict[str, list[int]] = defaultdict(list)
    assert value_of("result.absent", {"result": grows}) is None
    assert value_of("result['absent']", {"result": grows}) is None
    assert dict(grows) == {}


# -- refused constructs ----------------------------------------------------------------
REJECTED = {
    "call": "len(result)",
    "method call": "result.items.count(1)",
    "builtin call": "__import__('os')",
    "lambda": "(lambda: 1)",
    "list comprehension": "[x for x in result]",
    "set comprehension": "{x for x in result}",
    "dict comprehension": "{x: 1 for x in result}",
    "generator": "(x for x in result)",
    "f-string": "f'{result}'",
    "f-string with a call": "f'{len(result)}'",
    "walrus": "(x := 1)",
    "import statement": "import os",
    "statement": "x = 1",
    "two statements": "1; 2",
    "dunder name": "__builtins__",
    "private name": "_secret",
    "private attribute": "result._y",
    "dunder attribute": "result.__class__",
    "class walk": "result.__class__.__mro__",
    "subclass walk": "().__class__.__base__.__subclasses__",
    "globals walk": "result.__init__.__globals__",
    "starred": "[*result]",
    "slice": "result.items[1:2]",
    "open slice": "result.items[:]",
    "extended slice": "result.items[::2]",
    "bytes literal": "b'raw'",
    "complex literal": "1j",
    "ellipsis": "...",
    "set display": "{1, 2}",
    "dict display": "{'a': 1}",
    "conditional expression": "1 if result else 2",
    "addition": "result.count + 1",
    "subtraction": "result.count - 1",
    "multiplication": "'a' * 1000",
    "power": "2 ** 1000",
    "bitwise": "result.count | 1",
    "matrix multiplication": "result @ result",
    "is": "result is None",
    "is not": "result is not None",
    "unary minus on a name": "-result.count",
    "unary plus": "+1",
    "double minus": "--1",
    "minus on a bool": "-True",
    "minus on a string": "-'a'",
    "invert": "~1",
    "await": "await result",
    "yield": "(yield)",
    "empty": "",
    "blank": "   ",
    "unbalanced": "(result",
    "null byte": "result\x00",
    "keyword soup": "and or not",
    "a statement keyword": "pass",
}


@pytest.mark.parametrize("text", REJECTED.values(), ids=REJECTED.keys())
def test_every_refused_construct_raises_the_typed_error_with_the_edge_id(text):
    with pytest.raises(UnsafeExpressionError) as caught:
        parse_expression(text, edge_id="edge-9")
    assert caught.value.edge_id == "edge-9"
    assert isinstance(caught.value, OperationError)


def test_the_error_names_the_construct_and_what_is_allowed():
    with pytest.raises(UnsafeExpressionError, match=r"a call at column 1; allowed: comparisons"):
        parse_expression("len(result)")
    with pytest.raises(UnsafeExpressionError, match=r"private attribute '__class__'"):
        parse_expression("result.__class__")


def test_a_non_string_is_refused():
    with pytest.raises(UnsafeExpressionError):
        parse_expression(123)  # type: ignore[arg-type]


# -- budgets ---------------------------------------------------------------------------
def test_the_length_budget_admits_1000_characters_and_refuses_1001():
    assert MAX_EXPRESSION_LENGTH == 1000
    at_limit = "'" + "a" * (MAX_EXPRESSION_LENGTH - 2) + "'"
    assert len(at_limit) == 1000
    assert value_of(at_limit) == "a" * 998
    with pytest.raises(UnsafeExpressionError, match="1001 characters"):
        parse_expression(at_limit + " ", edge_id="e1")


def test_the_length_budget_is_checked_before_parsing():
    with mock.patch.object(expressions.ast, "parse", side_effect=AssertionError("parsed")):
        with pytest.raises(UnsafeExpressionError):
            parse_expression("(" * 5000)


def nested_not(levels: int) -> str:
    """``not not ... result.flag``: ``levels`` nots over a depth-2 attribute."""
    return "not " * levels + "result.flag"


def nested_lists(levels: int) -> str:
    """``[[[...[1]...]]]``: ``levels`` lists around a literal, so depth is levels + 1."""
    return "[" * levels + "1" + "]" * levels


def test_the_depth_budget_admits_20_levels_and_refuses_21():
    assert MAX_AST_DEPTH == 20
    assert value_of(nested_not(MAX_AST_DEPTH - 2)) is True  # 18 nots + Attribute + Name = 20
    assert value_of(nested_lists(MAX_AST_DEPTH - 1)) is not None  # 19 lists + Constant = 20
    with pytest.raises(UnsafeExpressionError, match="deeper than 20"):
        parse_expression(nested_not(MAX_AST_DEPTH - 1), edge_id="e2")
    with pytest.raises(UnsafeExpressionError, match="deeper than 20"):
        parse_expression(nested_lists(MAX_AST_DEPTH))


def test_a_negative_literal_counts_as_one_node():
    assert value_of("[" * (MAX_AST_DEPTH - 1) + "-1" + "]" * (MAX_AST_DEPTH - 1)) is not None


@pytest.mark.parametrize(
    "text",
    [
        "(" * 400 + "1" + ")" * 400,
        "[" * 450 + "]" * 450,
        "not " * 249 + "x",
        "-" * 999 + "1",
        "x" + ".y" * 499,
        "x" + "[0]" * 333,
        "1" + " < 1" * 249,  # wide rather than deep: one Compare, within budget
        "a and " * 166 + "a",
    ],
    ids=["parens", "lists", "nots", "minuses", "attributes", "subscripts", "chain", "and-chain"],
)
def test_huge_nesting_within_the_length_budget_is_a_typed_error_or_a_value_never_a_crash(text):
    assert len(text) <= MAX_EXPRESSION_LENGTH
    try:
        compiled = parse_expression(text)
    except UnsafeExpressionError:
        return
    compiled.evaluate({"x": {}, "a": True})


# -- the edge condition ----------------------------------------------------------------
def test_the_condition_reads_result_and_context():
    condition = ExpressionCondition("result.score > context.threshold")
    assert condition.apply({"result": {"score": 0.9}, "context": {"threshold": 0.5}}) is True
    assert condition.apply({"result": {"score": 0.1}, "context": {"threshold": 0.5}}) is False
    assert condition.apply({"result": None, "context": {}}) is False


def test_the_condition_fails_early_on_unsafe_text_or_an_unknown_name():
    with pytest.raises(UnsafeExpressionError) as caught:
        ExpressionCondition("result.__class__", edge_id="e3")
    assert caught.value.edge_id == "e3"
    with pytest.raises(UnsafeExpressionError, match="unknown name 'inputs'"):
        ExpressionCondition("inputs.topic == 'x'", edge_id="e4")


def test_the_condition_has_a_wire_form_a_repr_and_equality():
    condition = ExpressionCondition("result != None")
    assert condition.to_wire() == {"kind": "expression", "expression": "result != None"}
    assert repr(condition) == "ExpressionCondition('result != None')"
    assert condition == ExpressionCondition("result != None")
    assert condition != ExpressionCondition("result == None")
    assert len({condition, ExpressionCondition("result != None")}) == 1


def test_the_condition_and_a_compiled_expression_round_trip_through_pickle():
    condition = ExpressionCondition("result.score > 0.5 and context.topic in ['ray']", edge_id="e5")
    restored = pickle.loads(pickle.dumps(condition))
    assert restored == condition and restored.edge_id == "e5"
    assert restored.apply({"result": {"score": 0.6}, "context": {"topic": "ray"}}) is True
    compiled = pickle.loads(pickle.dumps(parse_expression("result.items[-1]", edge_id="e6")))
    assert compiled.edge_id == "e6"
    assert compiled.evaluate(VARIABLES) == 30


def test_a_closed_name_set_rejects_other_names_at_parse_time_and_survives_pickle():
    with pytest.raises(UnsafeExpressionError, match="unknown name 'other'"):
        parse_expression("other == 1", names={"result"}, edge_id="e8")
    compiled = pickle.loads(pickle.dumps(parse_expression("result", names={"result"})))
    assert compiled.names == frozenset({"result"})


def gated_graph(expression: str) -> tuple[Graph, str, str]:
    """a -[expression]-> b."""
    graph = Graph()
    a = graph.add_node(create_operation("chat", {"instruction": "score it"}))
    b = graph.add_node(create_operation("chat", {"instruction": "act on it"}))
    graph.add_edge(a, b, condition=ExpressionCondition(expression))
    return graph, a.id, b.id


@pytest.mark.parametrize(("score", "runs"), [(0.9, True), (0.2, False), (None, False)])
def test_the_scheduler_gates_a_node_on_the_expression(drive, score, runs):
    """a -[result.score > 0.5]-> b: b runs only on a high score."""
    graph, a, b = gated_graph("result.score > 0.5")
    driver = drive(graph)
    driver.complete(a, {"score": score})
    if runs:
        assert b in driver.dispatched()
        driver.complete(b, "done")
        assert driver.envelope["operation_statuses"][b] == "completed"
    else:
        assert b not in driver.dispatched()
        assert driver.envelope["skipped_operations"] == [b]


def test_the_scheduler_sees_a_pydantic_result_through_the_expression(drive):
    """a -[result.score > 0.5 and context.mode == 'go']-> b with a model result."""
    graph, a, b = gated_graph("result.score > 0.5 and context.mode == 'go'")
    driver = drive(graph, context={"mode": "go"})
    driver.complete(a, Report(score=0.8))
    assert b in driver.dispatched()


def test_a_graph_with_an_expression_edge_round_trips_through_the_codec():
    graph, a, b = gated_graph("result.score > 0.5")
    restored = decode(encode(graph))
    (edge,) = restored.edges.values()
    assert isinstance(edge.condition, ExpressionCondition)
    assert edge.condition.expression == "result.score > 0.5"
    assert (edge.head, edge.tail) == (a, b)
    assert edge.condition.apply({"result": {"score": 0.7}, "context": {}}) is True


@pytest.mark.parametrize(
    "payload",
    [
        {"kind": "expression"},
        {"kind": "expression", "expression": 3},
        {"kind": "expression", "expression": "f()"},
    ],
)
def test_a_malformed_or_unsafe_wire_condition_is_a_codec_error(payload):
    with pytest.raises(CodecError):
        ExpressionCondition.from_wire(payload)


# -- no code-execution surface ----------------------------------------------------------
def test_the_module_source_never_names_eval_exec_compile_or_import():
    tree = ast.parse(Path(expressions.__file__).read_text(encoding="utf-8"))
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert named.isdisjoint({"eval", "exec", "compile", "__import__", "getattr"})


def _trap(name: str):
    def trapped(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} was called during evaluation")

    return trapped


@contextmanager
def no_code_execution():
    """eval/exec/compile/__import__ raise while the block runs (parse happens outside it)."""
    with mock.patch.multiple(
        builtins,
        eval=_trap("eval"),
        exec=_trap("exec"),
        compile=_trap("compile"),
        __import__=_trap("__import__"),
    ):
        yield


def evaluate_safely(text: str, variables: dict[str, Any]) -> None:
    """The fuzz oracle: only UnsafeExpressionError may come out of parse or evaluate."""
    try:
        compiled = parse_expression(text)
    except UnsafeExpressionError:
        return
    try:
        with no_code_execution():
            compiled.evaluate(variables)
    except UnsafeExpressionError:
        pass


# -- fuzzing ----------------------------------------------------------------------------
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b", "score", "k"]), inner, max_size=3),
    max_leaves=12,
)
fuzz_variables = st.fixed_dictionaries({"result": json_values, "context": json_values})


@FUZZ
@given(text=st.text(max_size=60), variables=fuzz_variables)
@example(text="result.__class__.__mro__", variables={"result": {}, "context": {}})
@example(text="'\\d'", variables={"result": {}, "context": {}})
def test_fuzz_random_text_is_a_typed_error_or_a_safe_value(text, variables):
    evaluate_safely(text, variables)


@FUZZ
@given(
    text=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
    variables=fuzz_variables,
)
def test_fuzz_random_ascii_is_a_typed_error_or_a_safe_value(text, variables):
    evaluate_safely(text, variables)


NAMES = st.sampled_from(["result", "context", "x", "_hidden", "__builtins__", "__import__", "True", "None"])
ATTRIBUTES = st.sampled_from(
    ["a", "b", "score", "k", "items", "_x", "__class__", "__mro__", "__globals__", "__subclasses__"]
)
LITERALS = st.sampled_from(
    ["1", "-1", "0.5", "-2.5", "'a'", '"k"', "True", "None", "b'x'", "1j", "...", "10**9"]
)
COMPARE_OPS = st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "in", "not in", "is", "is not"])
BINARY_OPS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "|", "&", "^", "<<", "@"])


# One template per grammar shape, allowed and refused alike. Each takes three child texts,
# an attribute, a comparison, a binary operator and a repeat count (unused ones ignored).
# A single st.builds keeps Hypothesis's strategy labels cheap; a one_of with a branch per
# shape inside st.recursive costs it seconds per hundred examples.
TEMPLATES = [
    # allowed shapes
    lambda a, b, c, attr, cmp, bop, n: f"{a}.{attr}",
    lambda a, b, c, attr, cmp, bop, n: f"({a})[{b}]",
    lambda a, b, c, attr, cmp, bop, n: f"{a} {cmp} {b}",
    lambda a, b, c, attr, cmp, bop, n: f"{a} {cmp} {b} {cmp} {c}",
    lambda a, b, c, attr, cmp, bop, n: f"({a} and {b})",
    lambda a, b, c, attr, cmp, bop, n: f"({a} or {b} or {c})",
    lambda a, b, c, attr, cmp, bop, n: f"not {a}",
    lambda a, b, c, attr, cmp, bop, n: f"[{a}, {b}]",
    lambda a, b, c, attr, cmp, bop, n: f"({a}, {b},)",
    lambda a, b, c, attr, cmp, bop, n: f"({a})",
    # refused shapes
    lambda a, b, c, attr, cmp, bop, n: f"{a} {bop} {b}",
    lambda a, b, c, attr, cmp, bop, n: f"{a}({b}, {c})",
    lambda a, b, c, attr, cmp, bop, n: f"(lambda: {a})",
    lambda a, b, c, attr, cmp, bop, n: f"[v for v in {a}]",
    lambda a, b, c, attr, cmp, bop, n: f"f'{{{a}}}'",
    lambda a, b, c, attr, cmp, bop, n: f"(w := {a})",
    lambda a, b, c, attr, cmp, bop, n: f"[*{a}]",
    lambda a, b, c, attr, cmp, bop, n: f"{a}[{b}:{c}]",
    lambda a, b, c, attr, cmp, bop, n: f"{{{a}}}",
    lambda a, b, c, attr, cmp, bop, n: f"{{{a}: {b}}}",
    lambda a, b, c, attr, cmp, bop, n: f"{a} if {b} else {c}",
    lambda a, b, c, attr, cmp, bop, n: f"-{a}",
    lambda a, b, c, attr, cmp, bop, n: f"~{a}",
    lambda a, b, c, attr, cmp, bop, n: "(" * n + a + ")" * n,
    lambda a, b, c, attr, cmp, bop, n: "not " * n + a,
    lambda a, b, c, attr, cmp, bop, n: "[" * n + a + "]" * n,
    lambda a, b, c, attr, cmp, bop, n: a + f".{attr}" * n,
    lambda a, b, c, attr, cmp, bop, n: f"{a}.__class__.__mro__[1].__subclasses__()",
    lambda a, b, c, attr, cmp, bop, n: f"{a}.__init__.__globals__['__builtins__']",
]


def _compose(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(
        lambda template, *parts: template(*parts),
        st.sampled_from(TEMPLATES),
        children,
        children,
        children,
        ATTRIBUTES,
        COMPARE_OPS,
        BINARY_OPS,
        st.integers(1, 3) | st.integers(1, 300),  # mostly shallow, sometimes far over budget
    )


grammar_expressions = st.recursive(NAMES | LITERALS, _compose, max_leaves=15)


@FUZZ
@given(text=grammar_expressions, variables=fuzz_variables)
@example(text="result.__class__.__mro__", variables={"result": {}, "context": {}})
@example(text="(" * 300 + "1" + ")" * 300, variables={"result": {}, "context": {}})
@example(text="not " * 250 + "result", variables={"result": {}, "context": {}})
def test_fuzz_grammar_shaped_adversarial_expressions_are_a_typed_error_or_a_safe_value(text, variables):
    evaluate_safely(text, variables)


allowed_expressions = st.recursive(
    st.sampled_from(["result", "context", "1", "-1", "0.5", "'a'", "True", "None"]),
    lambda children: st.one_of(
        st.tuples(children, st.sampled_from(["a", "b", "score", "k"])).map(lambda t: f"({t[0]}).{t[1]}"),
        st.tuples(children, children).map(lambda t: f"({t[0]})[{t[1]}]"),
        st.tuples(children, COMPARE_OPS.filter(lambda op: not op.startswith("is")), children).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        st.tuples(children, st.sampled_from(["and", "or"]), children).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        children.map(lambda c: f"(not {c})"),
        st.lists(children, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
    ),
    max_leaves=10,
)


@FUZZ
@given(text=allowed_expressions, variables=fuzz_variables)
def test_fuzz_expressions_inside_the_grammar_evaluate_without_any_error(text, variables):
    try:
        compiled = parse_expression(text)
    except UnsafeExpressionError as exc:
        assert "deeper than" in exc.message  # the only way an in-grammar text can fail
        return
    with no_code_execution():
        compiled.evaluate(variables)
    condition = ExpressionCondition(text)
    assert condition.apply(variables) in (True, False)
