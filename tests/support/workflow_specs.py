"""Fixed-workflow definitions the cluster tests share, as the JSON a user would write.

    draft_spec:  in -> draft        (one chat node on ``model``; more nodes and edges may be added)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["draft_spec"]


def draft_spec(prompt: str = "Draft", model: str = "sim/fast", extra_nodes: Iterable[dict[str, Any]] = (),
               extra_edges: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """in -> draft: the input, then one chat node on ``model``, its output the workflow's."""
    return {
        "version": 1,
        "nodes": [
            {"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}},
            {"id": "draft", "kind": "chat", "pos": {"x": 1, "y": 0}, "config": {"prompt": prompt, "model": model}},
            *extra_nodes,
        ],
        "edges": [{"id": "e1", "from": "in", "to": "draft"}, *extra_edges],
        "inputs": ["topic"],
        "outputs": ["draft"],
    }
