"""A run's graph as the console draws it: nodes folded into groups, laid out left to right, as SVG.

Owns folding a fan-out (many siblings of the same operation between the same neighbours)
into one group shape with counts by state, the layered layout of the shapes (``grandalf``,
Sugiyama, turned to run left to right), and the SVG markup, with every value escaped. It
reads nothing: the routes hand it the run's outline and node states.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from html import escape
from typing import Any
from urllib.parse import quote

from grandalf.graphs import Edge as LayoutEdge
from grandalf.graphs import Graph as LayoutGraph
from grandalf.graphs import Vertex
from grandalf.layouts import SugiyamaLayout

__all__ = ["BAR_ORDER", "GROUP_MIN", "STATES", "GraphModel", "Shape", "build_model", "group_state", "node_state",
           "render_svg"]

# A class of interchangeable siblings is folded into one group from this many members.
GROUP_MIN = 6
NODE_WIDTH, NODE_HEIGHT, GROUP_HEIGHT = 168, 40, 58
LAYER_GAP, ROW_GAP = 70, 18
# Each state: (icon, words); the colour is the stylesheet's, the icon tells states apart without it.
STATES: dict[str, tuple[str, str]] = {
    "pending": ("○", "not started"), "queued": ("◔", "queued"), "running": ("▶", "running"),
    "completed": ("✓", "completed"), "failed": ("✗", "failed"), "skipped": ("↷", "skipped"),
    "cancelled": ("■", "cancelled"),
}
_SIGNAL_STATES = {"started": "running", "queued": "queued", "completed": "completed", "failed": "failed",
                  "skipped": "skipped", "cancelled": "cancelled", "running": "running", "pending": "pending"}


def node_state(kind: str | None) -> str:
    """A signal kind or settled status as one of ``STATES`` (an unknown kind is shown as running)."""
    if kind is None:
        return "pending"
    return _SIGNAL_STATES.get(kind, "running")


@dataclass
class Shape:
    """One box in the drawing: a node, or a group of interchangeable siblings (``members``)."""

    id: str
    label: str
    operation: str
    members: list[str]
    group: bool
    x: float = 0.0
    y: float = 0.0
    width: float = NODE_WIDTH
    height: float = NODE_HEIGHT


@dataclass
class GraphModel:
    """The folded graph: shapes, the edges between them, and where each node went."""

    shapes: dict[str, Shape]
    edges: list[tuple[str, str]]
    shape_of: dict[str, str]
    names: dict[str, str]
    predecessors: dict[str, list[str]] = field(default_factory=dict)
    width: float = 0.0
    height: float = 0.0
    laid_out: bool = field(default=False)

    def counts(self, shape_id: str, states: Mapping[str, str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for member in self.shapes[shape_id].members:
            state = states.get(member, "pending")
            counts[state] = counts.get(state, 0) + 1
        return counts


def _classes(nodes: list[str], operation: Mapping[str, str], predecessors: Mapping[str, list[str]],
             successors: Mapping[str, list[str]]) -> dict[str, int]:
    """Partition refinement: nodes of one operation whose neighbours fall in the same classes share a class."""
    names: dict[Any, int] = {}
    cls = {node: names.setdefault(operation[node], len(names)) for node in nodes}
    count = len(names)
    for _ in range(8):
        names = {}
        refined = {}
        for node in nodes:
            key = (cls[node], frozenset(cls[p] for p in predecessors.get(node, ())),
                   frozenset(cls[s] for s in successors.get(node, ())))
            refined[node] = names.setdefault(key, len(names))
        cls = refined
        if len(names) == count:
            break
        count = len(names)
    return cls


def _shape_id(kind: str, text: str) -> str:
    return kind + hashlib.blake2s(text.encode("utf-8"), digest_size=6).hexdigest()


def build_model(outline: Mapping[str, Any] | None, extra_nodes: Mapping[str, str] = (),
                group_min: int = GROUP_MIN) -> GraphModel:
    """Fold ``outline`` (``{"nodes": [[id, name, operation]], "edges": [[from, to]]}``) into shapes.

    ``extra_nodes`` (``{node_id: name}``) are nodes the run has that its outline lacks (spawned as it
    went); each is drawn by its name's operation, without edges.
    """
    outline = outline or {"nodes": [], "edges": []}
    names: dict[str, str] = {}
    operation: dict[str, str] = {}
    for node_id, name, op in outline.get("nodes", ()):
        names[str(node_id)] = str(name)
        operation[str(node_id)] = str(op)
    for node_id, name in dict(extra_nodes).items():
        if node_id not in names:
            names[node_id] = str(name or node_id)
            operation[node_id] = str(name or "spawned")
    nodes = list(names)
    predecessors: dict[str, list[str]] = {}
    successors: dict[str, list[str]] = {}
    for head, tail in outline.get("edges", ()):
        if head in names and tail in names:
            successors.setdefault(head, []).append(tail)
            predecessors.setdefault(tail, []).append(head)
    classes = _classes(nodes, operation, predecessors, successors)
    members: dict[int, list[str]] = {}
    for node in nodes:
        members.setdefault(classes[node], []).append(node)
    shapes: dict[str, Shape] = {}
    shape_of: dict[str, str] = {}
    for group in members.values():
        if len(group) >= group_min:
            first = group[0]
            shape = Shape(_shape_id("g", first), operation[first], operation[first], group, True,
                          height=GROUP_HEIGHT)
            shapes[shape.id] = shape
            for node in group:
                shape_of[node] = shape.id
        else:
            for node in group:
                shape = Shape(_shape_id("n", node), names[node], operation[node], [node], False)
                shapes[shape.id] = shape
                shape_of[node] = shape.id
    edges = sorted({(shape_of[head], shape_of[tail]) for head, tails in successors.items() for tail in tails
                    if shape_of[head] != shape_of[tail]})
    return GraphModel(shapes, edges, shape_of, names, predecessors)


class _View:
    """What grandalf places: a box of the size given (width and height swapped, as it lays out top-down)."""

    def __init__(self, width: float, height: float) -> None:
        self.w, self.h = width, height
        self.xy = (0.0, 0.0)


def layout(model: GraphModel) -> GraphModel:
    """Place the shapes in layers by dependency, left to right (grandalf's Sugiyama layout, turned)."""
    if model.laid_out:
        return model
    vertices = {shape_id: Vertex(shape_id) for shape_id in model.shapes}
    for shape_id, vertex in vertices.items():
        shape = model.shapes[shape_id]
        vertex.view = _View(shape.height, shape.width)  # top-down: "width" is the drawing's height
    graph = LayoutGraph(list(vertices.values()), [LayoutEdge(vertices[a], vertices[b]) for a, b in model.edges])
    offset, width = 20.0, 0.0
    for component in graph.C:
        if len(component.sV) == 1:
            (vertex,) = component.sV
            vertex.view.xy = (vertex.view.w / 2, vertex.view.h / 2)
        else:
            sugiyama = SugiyamaLayout(component)
            sugiyama.xspace, sugiyama.yspace = ROW_GAP, LAYER_GAP
            sugiyama.init_all()
            sugiyama.draw()
        low_across = min(v.view.xy[0] - v.view.w / 2 for v in component.sV)
        low_along = min(v.view.xy[1] - v.view.h / 2 for v in component.sV)
        high_across = 0.0
        for vertex in component.sV:
            shape = model.shapes[vertex.data]
            across, along = vertex.view.xy
            shape.x = 20.0 + along - vertex.view.h / 2 - low_along
            shape.y = offset + across - vertex.view.w / 2 - low_across
            high_across = max(high_across, shape.y + shape.height)
            width = max(width, shape.x + shape.width)
        offset = high_across + ROW_GAP * 2
    model.width, model.height = width + 20, offset
    model.laid_out = True
    return model


def _clip(text: str, limit: int = 22) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _counts_text(counts: Mapping[str, int]) -> str:
    order = ("completed", "running", "queued", "failed", "cancelled", "skipped", "pending")
    return "  ".join(f"{STATES[state][0]}{counts[state]:,}" for state in order if counts.get(state))


BAR_ORDER = ("completed", "running", "queued", "failed", "cancelled", "skipped", "pending")


def group_state(counts: Mapping[str, int]) -> str:
    """The state a group shows as a whole: failed if any failed, running while any runs, else the most common."""
    if counts.get("failed"):
        return "failed"
    if counts.get("running") or counts.get("queued"):
        return "running"
    return max(counts, key=counts.get) if counts else "pending"


def _bar(shape: Shape, counts: Mapping[str, int]) -> str:
    """A bar of the group's members by state (one segment per state, in ``BAR_ORDER``), under its name."""
    total = max(1, sum(counts.values()))
    width, x = shape.width - 20, shape.x + 10
    parts = [f'<g class="bar" data-x="{x:.0f}" data-width="{width:.0f}">']
    for state in BAR_ORDER:
        part = width * counts.get(state, 0) / total
        parts.append(f'<rect class="seg-{state}" x="{x:.1f}" y="{shape.y + 25:.0f}" width="{part:.1f}" height="12"/>')
        x += part
    parts.append("</g>")
    return "".join(parts)


def render_svg(model: GraphModel, states: Mapping[str, str], *, run_id: str) -> str:
    """The laid-out ``model`` as an SVG document fragment; every name and id is escaped."""
    layout(model)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" role="group" '
             f'aria-label="graph of run {escape(run_id)}" width="{model.width:.0f}" height="{model.height:.0f}" '
             f'viewBox="0 0 {model.width:.0f} {model.height:.0f}">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" class="arrowhead"/></marker></defs>']
    for head, tail in model.edges:
        a, b = model.shapes[head], model.shapes[tail]
        x1, y1, x2, y2 = a.x + a.width, a.y + a.height / 2, b.x, b.y + b.height / 2
        middle = (x1 + x2) / 2
        parts.append(f'<path class="edge" marker-end="url(#arrow)" '
                     f'd="M{x1:.0f},{y1:.0f} C{middle:.0f},{y1:.0f} {middle:.0f},{y2:.0f} {x2:.0f},{y2:.0f}"/>')
    for shape in model.shapes.values():
        parts.append(_shape_svg(model, shape, states, run_id))
    parts.append("</svg>")
    return "".join(parts)


def _shape_svg(model: GraphModel, shape: Shape, states: Mapping[str, str], run_id: str) -> str:
    label = escape(_clip(shape.label))
    if shape.group:
        counts = model.counts(shape.id, states)
        href = escape(f"/runs/{quote(run_id, safe='')}/groups/{shape.id}")
        return (f'<a href="{href}" class="shape group s-{group_state(counts)}" id="{shape.id}" data-group="{shape.id}" '
                f'aria-label="group {escape(shape.label)} of {len(shape.members):,} nodes">'
                f'<title>{escape(shape.label)}: {len(shape.members):,} nodes</title>'
                f'<rect class="stack" x="{shape.x + 6:.0f}" y="{shape.y - 6:.0f}" width="{shape.width:.0f}" '
                f'height="{shape.height:.0f}" rx="6"/>'
                f'<rect class="body" x="{shape.x:.0f}" y="{shape.y:.0f}" width="{shape.width:.0f}" '
                f'height="{shape.height:.0f}" rx="6"/><text class="name" x="{shape.x + 10:.0f}" '
                f'y="{shape.y + 17:.0f}">{label} ×{len(shape.members):,}</text>'
                f'{_bar(shape, counts)}<text class="counts" x="{shape.x + 10:.0f}" '
                f'y="{shape.y + 50:.0f}">{escape(_counts_text(counts))}</text></a>')
    node = shape.members[0]
    state = states.get(node, "pending")
    icon, words = STATES.get(state, STATES["running"])
    href = escape(f"/runs/{quote(run_id, safe='')}/nodes/{quote(node, safe='')}")
    name = escape(shape.label)
    return (f'<a href="{href}" class="shape node s-{escape(state)}" id="n-{escape(node)}" data-node="{escape(node)}" '
            f'aria-label="node {name}: {words}"><title>{name} ({escape(shape.operation)}): {words}</title>'
            f'<rect x="{shape.x:.0f}" y="{shape.y:.0f}" width="{shape.width:.0f}" '
            f'height="{shape.height:.0f}" rx="6"/><text class="icon" x="{shape.x + 10:.0f}" '
            f'y="{shape.y + 25:.0f}">{icon}</text><text class="name" x="{shape.x + 28:.0f}" '
            f'y="{shape.y + 25:.0f}">{label}</text></a>')


def group_members(model: GraphModel, shape_id: str) -> Iterable[str]:
    return model.shapes[shape_id].members
