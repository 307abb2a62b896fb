"""Small named graphs for the pure kernel tests, and the ways those tests start and read them.

Shared by the FlowState test modules of tests/kernel, imported by name (this folder is on
pytest's ``pythonpath``). Imports only opgraph.kernel, never Ray: tests/kernel stays pure.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from opgraph.kernel import EdgeCondition, Graph, create_operation

__all__ = ["CONDITIONS", "PASSING_CONDITIONS", "build", "context_of", "nested", "reactive"]


def build(*names: str, edges: tuple[tuple[str, str], ...] = ()) -> tuple[Graph, SimpleNamespace]:
    """Nodes named ``names`` (instruction "do <name>") and unconditional ``edges``."""
    graph = Graph()
    ids = {}
    for name in names:
        node = create_operation("chat", {"instruction": f"do {name}"}, metadata={"reference_id": name})
        graph.add_node(node)
        ids[name] = node.id
    for head, tail in edges:
        graph.add_edge(ids[head], ids[tail])
    return graph, SimpleNamespace(**ids)


def reactive(drive, *names: str, edges=(), **options: Any):
    """``build`` the graph and start it through the ``drive`` fixture as a reactive run.

    The default branch is "default" unless the options name another.
    """
    graph, n = build(*names, edges=edges)
    options.setdefault("default_branch_id", "default")
    return drive(graph, reactive=True, **options), n


def context_of(driver, node_id: str) -> dict[str, Any]:
    """The context of ``node_id``'s outstanding dispatch."""
    return driver.dispatched()[node_id].parameters["context"]


def nested(depth: int) -> list:
    """A list ``depth`` levels deep: a result that outnests the recursion limit at 5,000."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# -- edge conditions, by the name a generated graph gives them ----------------------------
class AlwaysTrue(EdgeCondition):
    verdict = True

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        return True


class AlwaysFalse(EdgeCondition):
    verdict = False

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002
        return False


class AsyncAlwaysTrue(EdgeCondition):
    """Evaluated by the shell; the test's driver answers with ``verdict`` and never awaits apply."""

    verdict = True

    async def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002
        return True


class AsyncAlwaysFalse(EdgeCondition):
    verdict = False

    async def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002
        return False


CONDITIONS: dict[str, type[EdgeCondition] | None] = {
    "none": None,
    "true": AlwaysTrue,
    "false": AlwaysFalse,
    "async_true": AsyncAlwaysTrue,
    "async_false": AsyncAlwaysFalse,
}
PASSING_CONDITIONS = frozenset({"none", "true", "async_true"})  # the conditions that let a node run
