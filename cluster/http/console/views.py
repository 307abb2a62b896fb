"""The console's pages: the runs list, a run's page with its graph, a node's panel, a group's members.

Owns what each page shows and how (Jinja2 templates with autoescape: every value from a run,
model output, node names and errors included, is escaped) and the static files. It reads the
run store only; the live feed is live.py's, the controls post to the JSON API, and the guard
(guard.py) signs every request in before it gets here.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from jinja2 import Environment, FileSystemLoader, pass_context, select_autoescape
from markupsafe import Markup

from ...store import RUN_STATUSES, EngineRunNotFoundError, EngineRunStore, RunRecord, RunStore
from ..guard import AccessPolicy
from ..problems import UnknownNameError
from .control_pages import ControlPages
from .graph import STATES, GraphModel, build_model, node_state, render_svg

__all__ = ["PAGE_SIZE", "TRUNCATE_AT", "Console", "run_state"]

HERE = Path(__file__).parent
PAGE_SIZE = 50  # runs on a page of the list
MEMBERS_PAGE = 200  # a group's members on a page of its panel
TRUNCATE_AT = 4000  # characters of one value shown in a panel; the rest is behind a link
_MODEL_CACHE = 64  # runs whose folded graph is kept (a finished run's outline never changes)
_STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}
_CONTROLS = {
    "cancel": ("cancel", "Cancel this run? Nodes still running are cancelled."),
    "pause": ("pause", "Pause this run? Running nodes finish; no new node starts."),
    "resume": ("resume", "Resume this run?"),
    "message": ("send a message", ""),
    "recover": ("resume from the run log", "Continue this failed durable run from its run log? Settled nodes "
                                           "do not run again."),
}


def run_state(status: str) -> str:
    """A run status as one of the drawing's states."""
    return {"admitted": "queued", "running": "running"}.get(status, status)


def _when(timestamp: float | None) -> str:
    return "" if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def counts_text(counts: Mapping[str, int]) -> str:
    order = ("completed", "running", "queued", "failed", "cancelled", "skipped", "pending")
    return " ".join(f"{STATES[state][0]}{counts[state]:,}" for state in order if counts.get(state)) or "–"


def _usage_text(usage: Any) -> str:
    if not isinstance(usage, Mapping):
        return "none recorded"
    parts = [f"{int(usage.get('total_tokens') or 0):,} tokens"]
    if usage.get("prompt_tokens") is not None:
        parts.append(f"(prompt {int(usage.get('prompt_tokens') or 0):,}, "
                     f"completion {int(usage.get('completion_tokens') or 0):,})")
    if usage.get("calls"):
        parts.append(f"in {usage['calls']} call(s)")
    if usage.get("cost_usd") is not None:
        parts.append(f"${float(usage['cost_usd']):.4f}")
    return " ".join(parts)


@pass_context
def _value_box(context: Any, value: Any) -> Markup:
    """A value in a ``<pre>``, escaped; past ``TRUNCATE_AT`` characters cut, with a link to the whole."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str, ensure_ascii=False)
    if len(text) <= TRUNCATE_AT:
        return Markup(f"<pre>{escape(text)}</pre>")
    whole = context.get("whole_url") or ""
    return Markup(f"<pre>{escape(text[:TRUNCATE_AT])}…</pre><p class=\"truncated\">{len(text) - TRUNCATE_AT:,} "
                  f"more characters: <a href=\"{escape(whole)}\">the whole value</a></p>")


def _message(message: Any) -> dict[str, Any]:
    """A branch message as the panel shows it: role, sender, content and tool calls."""
    if not isinstance(message, Mapping):
        return {"role": "message", "name": None, "content": message, "tool_calls": []}
    calls = []
    for call in message.get("tool_calls") or ():
        if isinstance(call, Mapping):
            function = call.get("function") if isinstance(call.get("function"), Mapping) else call
            calls.append({"name": str(function.get("name", "")), "arguments": function.get("arguments",
                                                                                         function.get("input"))})
    role = str(message.get("role") or message.get("sender") or "message")
    content = message.get("content", message.get("text"))
    if content is None and not calls:
        content = {key: value for key, value in message.items() if key != "role"}
    name = message.get("name") or message.get("tool_call_id")
    return {"role": role, "name": None if name is None else str(name), "content": "" if content is None else content,
            "tool_calls": calls}


class Console:
    """The console over ``store``: installs its routes on an app (``install``)."""

    def __init__(self, store: RunStore, access: AccessPolicy, *, live_runs: Callable[[str], bool]) -> None:
        self.store = store
        self.access = access
        self.live_runs = live_runs  # whether this server can reach a run's executor (its controls work here)
        self.templates = Environment(loader=FileSystemLoader(HERE / "templates"),
                                     autoescape=select_autoescape(default=True, default_for_string=True))
        self.templates.globals.update(icon=lambda state: STATES.get(state, STATES["running"])[0],
                                      value_box=_value_box, states=STATES)
        self._models: OrderedDict[str, tuple[int, GraphModel]] = OrderedDict()
        self._static = {name: (HERE / "static" / name).read_bytes() for name in _STATIC}
        self.sign_in_page = (HERE / "templates" / "sign_in.html").read_bytes()
        self._engines: EngineRunStore | None = None
        self.control = ControlPages(store)
        self.templates.globals["zip"] = zip

    # -- shared ----------------------------------------------------------------------------
    def render(self, name: str, **values: Any) -> str:
        return self.templates.get_template(name).render(csrf=self.access.csrf_token, **values)

    def model(self, run_id: str, states: Mapping[str, str] | None = None) -> GraphModel:
        """The run's folded graph, kept while its node count stays the same (a live run may grow)."""
        states = states if states is not None else {}
        outline = self.store.run_outline(run_id)
        extra: dict[str, str] = {}
        known = {node[0] for node in outline["nodes"]} if outline else set()
        if len(states) > len(known) or not outline:
            names = {row["node_id"]: row["spec_node_id"] for row in self.store.run_signals(run_id)
                     if row["node_id"] != run_id and row["node_id"] not in known}
            extra = {node_id: name or node_id for node_id, name in names.items()}
        size = len(known) + len(extra)
        cached = self._models.get(run_id)
        if cached is not None and cached[0] == size:
            self._models.move_to_end(run_id)
            return cached[1]
        model = build_model(outline, extra)
        self._models[run_id] = (size, model)
        while len(self._models) > _MODEL_CACHE:
            self._models.popitem(last=False)
        return model

    def states(self, run_id: str) -> dict[str, str]:
        return {node: node_state(kind) for node, kind in self.store.node_states(run_id).items()}

    def run_view(self, record: RunRecord, summary: Mapping[str, Any] | None) -> dict[str, Any]:
        summary = summary or {}
        end = record.finished_at or (time.time() if not record.terminal else None)
        return {
            "run_id": record.run_id, "status": record.status, "state": run_state(record.status),
            "lane": record.lane, "workflow": record.workflow_name or record.source_ref, "version": record.version,
            "started": _when(record.started_at or record.created_at),
            "duration": _seconds(None if end is None else end - (record.started_at or record.created_at)),
            "counts": counts_text(summary.get("counts", {})),
            "tokens": f"{summary.get('tokens', 0):,}" if summary.get("tokens") else "–",
            "cost": f"${summary['cost_usd']:.4f}" if summary.get("cost_usd") else "–",
            "error": None if not record.error else json.dumps(record.error, indent=2, default=str,
                                                              ensure_ascii=False),
        }

    # -- pages -----------------------------------------------------------------------------
    def runs_page(self, status: str | None, lane: str | None, workflow: str | None, page: int) -> str:
        filters = {"status": status or None, "lane": lane or None, "workflow": workflow or None}
        records = self.store.list_runs(**filters, limit=PAGE_SIZE + 1, offset=(page - 1) * PAGE_SIZE)
        more, records = len(records) > PAGE_SIZE, records[:PAGE_SIZE]
        summary = self.store.node_summary(record.run_id for record in records)
        query = {key: value for key, value in filters.items() if value}

        def page_url(number: int) -> str:
            return "/?" + urlencode({**query, "page": number})

        return self.render(
            "runs.html", runs=[self.run_view(record, summary.get(record.run_id)) for record in records],
            filters=filters, statuses=RUN_STATUSES, lanes=self._lanes(), page=page,
            prev_url=page_url(page - 1) if page > 1 else None, next_url=page_url(page + 1) if more else None,
            live_query=urlencode({**query, "limit": PAGE_SIZE}))

    def _lanes(self) -> list[str]:
        with self.store.transaction() as db:
            return [row[0] for row in db.execute("SELECT DISTINCT lane FROM runs ORDER BY lane")]

    def run_page(self, run_id: str, record: RunRecord) -> str:
        states = self.states(run_id)
        model = self.model(run_id, states)
        summary = self.store.node_summary([run_id]).get(run_id)
        view = self.run_view(record, summary)
        live = not record.terminal
        controls = []
        capabilities = record.capabilities or {}
        if live:
            wanted = [("cancel", "cancel"), ("pause", "live_pause"), ("resume", "live_pause"),
                      ("message", "live_message")]
            controls = [name for name, capability in wanted if capabilities.get(capability)]
        elif record.orphaned and capabilities.get("checkpoint_resume"):
            controls = ["recover"]
        return self.render(
            "run.html", run=view, svg=Markup(render_svg(model, states, run_id=run_id)), live=live,
            controls=[{"action": name, "label": _CONTROLS[name][0], "confirm": _CONTROLS[name][1],
                       "message": name == "message"} for name in controls])

    def node_page(self, run_id: str, record: RunRecord, node_id: str, fragment: bool) -> str:
        model = self.model(run_id)
        settled = self.store.run_node(run_id, node_id)
        signals = self.store.node_signals(run_id, node_id)
        state = node_state(settled["status"] if settled is not None else signals[-1]["kind"] if signals else None)
        if node_id not in model.shape_of and settled is None and not signals:
            raise UnknownNameError(f"run {run_id} has no node {node_id!r}")
        name = model.names.get(node_id) or (settled or {}).get("spec_node_id") or node_id
        shape = model.shapes.get(model.shape_of.get(node_id, ""))
        result = None if settled is None else settled["result"]
        error, error_type = _node_error(record, name, node_id, state, result)
        usage = result.get("usage") if isinstance(result, Mapping) else None
        node = {"id": node_id, "name": name, "operation": shape.operation if shape is not None else name,
                "state": state, "attempts": sum(1 for signal in signals if signal["kind"] == "started"),
                "timings": _timings(signals), "error": error, "error_type": error_type or ("error" if error else None),
                "usage": _usage_text(usage), "inputs": self._node_inputs(run_id, record, model, node_id),
                "result": result, "branches": self._node_branches(run_id, name, node_id, result),
                "signals": [{**signal, "at": _when(signal["at"]), "elapsed": _seconds(signal["elapsed"])}
                            for signal in signals]}
        return self.render("node.html", node=node, run_id=run_id, fragment=fragment,
                           whole_url=f"/runs/{run_id}/nodes/{node_id}/whole")

    def _node_inputs(self, run_id: str, record: RunRecord, model: Any, node_id: str) -> list[tuple[str, Any]]:
        """What the node was given: the run's inputs, then each predecessor's result (the first 20)."""
        inputs: list[tuple[str, Any]] = []
        if record.inputs:
            inputs.append(("run inputs", record.inputs))
        for head in model.predecessors.get(node_id, [])[:20]:
            before = self.store.run_node(run_id, head)
            if before is not None:
                inputs.append((f"from {model.names.get(head, head)}", before["result"]))
        return inputs

    def _node_branches(self, run_id: str, name: str, node_id: str, result: Any) -> list[dict[str, Any]]:
        """The node's conversation: its own branches, else the run's shared branch with its answer marked
        (a node without a branch of its own took its turn there)."""
        recorded_branches = self.store.run_branches(run_id)
        own = [branch for branch in recorded_branches if branch["node_id"] in (name, node_id)]
        shared = not own
        answer = result.get("text") if isinstance(result, Mapping) else result if isinstance(result, str) else None
        branches = []
        for branch in own or [branch for branch in recorded_branches if branch["node_id"] is None]:
            messages = [_message(message) for message in branch["messages"]]
            for message in messages:
                message["own"] = bool(answer) and message["role"] == "assistant" and message["content"] == answer
            if not shared or any(message["own"] for message in messages):
                branches.append({"branch_id": branch["branch_id"], "shared": shared, "messages": messages})
        return branches

    def node_whole(self, run_id: str, node_id: str) -> str:
        settled = self.store.run_node(run_id, node_id)
        if settled is None:
            raise UnknownNameError(f"node {node_id!r} of run {run_id} has not settled; it has no result yet")
        return json.dumps(settled, indent=2, default=str, ensure_ascii=False)

    def group_page(self, run_id: str, group_id: str, page: int, fragment: bool) -> str:
        states = self.states(run_id)
        model = self.model(run_id, states)
        shape = model.shapes.get(group_id)
        if shape is None or not shape.group:
            raise UnknownNameError(f"run {run_id} has no group {group_id!r}")
        offset = (page - 1) * MEMBERS_PAGE
        members = [{"id": member, "name": model.names.get(member, member), "state": states.get(member, "pending")}
                   for member in shape.members[offset:offset + MEMBERS_PAGE]]
        base = f"/runs/{run_id}/groups/{group_id}?page="
        return self.render(
            "group.html", group={"id": group_id, "label": shape.label, "size": len(shape.members)},
            counts=counts_text(model.counts(group_id, states)), members=members, offset=offset, run_id=run_id,
            fragment=fragment, prev_url=f"{base}{page - 1}" if page > 1 else None,
            next_url=f"{base}{page + 1}" if offset + MEMBERS_PAGE < len(shape.members) else None)

    # -- engine runs -------------------------------------------------------------------------
    def engine_store(self) -> EngineRunStore:
        """The engines' records, in the run store's own database (opened on first use)."""
        if self._engines is None:
            self._engines = EngineRunStore(self.store.path)
        return self._engines

    def engine_runs_page(self) -> str:
        engines = self.engine_store()
        runs = []
        for record in engines.list_runs(limit=PAGE_SIZE):
            end = record.finished_at or time.time()
            runs.append({"run_id": record.run_id, "engine": record.engine, "status": record.status,
                         "state": _ENGINE_STATES.get(record.status, record.status),
                         "started": _when(record.created_at), "duration": _seconds(end - record.created_at),
                         "events": (record.statistics or {}).get("events", "")})
        return self.render("engine_runs.html", runs=runs)

    def engine_run_page(self, run_id: str) -> str:
        engines = self.engine_store()
        record = engines.get_run(run_id)
        events = engines.events(run_id, limit=5000)
        first = events[0]["at"] if events else record.created_at
        rows = [{"seq": event["seq"], "offset": _seconds(max(0.0, event["at"] - first)), "kind": event["kind"],
                 "type": event["type"], "agent": event["agent"],
                 "data": _clip(json.dumps(event["data"], default=str, ensure_ascii=False), 400)} for event in events]
        tree, title = engine_tree(events)
        end = record.finished_at or time.time()
        run = {"run_id": record.run_id, "engine": record.engine, "status": record.status,
               "state": _ENGINE_STATES.get(record.status, record.status), "started": _when(record.created_at),
               "duration": _seconds(end - record.created_at), "degrade_reason": record.degrade_reason,
               "inputs": record.inputs, "result": record.result, "error": record.error}
        return self.render("engine_run.html", run=run, events=rows, tree=tree, tree_title=title,
                           whole_url="")

    # -- routes ----------------------------------------------------------------------------
    def install(self, app: FastAPI, read: Callable[[str], RunRecord]) -> None:
        """The console's routes on ``app`` (out of the OpenAPI document: they answer HTML)."""

        def html(text: str) -> HTMLResponse:
            return HTMLResponse(text, headers={"cache-control": "no-store", "x-frame-options": "DENY",
                                               "content-security-policy": _CSP})

        @app.get("/console/static/{name}", include_in_schema=False)
        def static(name: str) -> Response:
            if name not in self._static:
                raise UnknownNameError(f"the console has no file {name!r}")
            return Response(self._static[name], media_type=_STATIC[name],
                            headers={"cache-control": "max-age=300"})

        @app.get("/runs/{run_id}", include_in_schema=False)
        def run_page(run_id: str) -> HTMLResponse:
            return html(self.run_page(run_id, read(run_id)))

        @app.get("/runs/{run_id}/nodes/{node_id}", include_in_schema=False)
        def node_page(request: Request, run_id: str, node_id: str) -> HTMLResponse:
            return html(self.node_page(run_id, read(run_id), node_id, _fragment(request)))

        @app.get("/runs/{run_id}/nodes/{node_id}/whole", include_in_schema=False)
        def node_whole(run_id: str, node_id: str) -> PlainTextResponse:
            read(run_id)
            return PlainTextResponse(self.node_whole(run_id, node_id), headers={"cache-control": "no-store"})

        @app.get("/runs/{run_id}/groups/{group_id}", include_in_schema=False)
        def group_page(request: Request, run_id: str, group_id: str,
                       page: int = Query(default=1, ge=1, le=1_000_000)) -> HTMLResponse:
            read(run_id)
            return html(self.group_page(run_id, group_id, page, _fragment(request)))

        @app.get("/engine-runs", include_in_schema=False)
        def engine_runs_page() -> HTMLResponse:
            return html(self.engine_runs_page())

        @app.get("/engine-runs/{run_id}", include_in_schema=False)
        def engine_run_page(run_id: str) -> HTMLResponse:
            try:
                return html(self.engine_run_page(run_id))
            except EngineRunNotFoundError as exc:
                raise UnknownNameError(f"no engine run {run_id!r} in this store") from exc

        pages = {
            "schedules": ("Schedules", "Each schedule, its next time and its fires so far.", "/api/schedules",
                          lambda state: self.control.schedules()),
            "tasks": ("Task queue", "The newest tasks, any state (filter with ?state=).", "/api/tasks",
                      lambda state: self.control.tasks(state)),
            "webhooks": ("Webhook deliveries", "The newest deliveries of each endpoint, with their attempts.",
                         "/api/webhooks", lambda state: self.control.deliveries()),
        }

        @app.get("/control/{page}", include_in_schema=False)
        def control_page(page: str, state: str | None = Query(default=None, max_length=40)) -> HTMLResponse:
            if page not in pages:
                raise UnknownNameError(f"the console has no control page {page!r}; it has {', '.join(pages)}")
            title, about, api, read = pages[page]
            columns, rows = read(state)
            return html(self.render("control.html", title=title, about=about, api=api, columns=columns, rows=rows))

        self.html = html


# Scripts and styles from this server only; no inline script, no frames, no other origin.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
        "base-uri 'none'; form-action 'self'")


_ENGINE_STATES = {"running": "running", "completed": "completed", "degraded": "skipped", "failed": "failed",
                  "cancelled": "cancelled"}
_TREE_KEYS = ("id", "node_id", "node", "label", "name")
_TREE_LABELS = ("label", "topic", "question", "statement", "title", "summary", "text", "description")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def engine_tree(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """An engine run's tree (events that name a ``parent``: research nodes, hypotheses under findings) or,
    without one, its chain (events that carry a ``round``: coding rounds); empty when it has neither."""
    items: dict[str, dict[str, Any]] = {}
    roots: list[dict[str, Any]] = []
    parents: list[tuple[dict[str, Any], str]] = []
    tops: list[dict[str, Any]] = []  # keyed events without a parent: a tree's roots once they have children
    rounds: dict[Any, dict[str, Any]] = {}
    for event in events:
        data = event["data"] if isinstance(event["data"], Mapping) else {}
        key = next((str(data[name]) for name in _TREE_KEYS if data.get(name) not in (None, "")), None)
        label = next((str(data[name]) for name in _TREE_LABELS if data.get(name) not in (None, "")), key or "")
        item = {"type": event["type"], "label": _clip(label, 200), "children": []}
        if "parent" in data or "parent_id" in data:
            parent = data.get("parent") or data.get("parent_id")
            if key is not None:
                items[key] = item
            parents.append((item, str(parent) if parent else ""))
        elif key is not None and key not in items:
            items[key] = item
            tops.append(item)
        if data.get("round") is not None:
            chain = rounds.setdefault(data["round"], {"type": "round", "label": f"round {data['round']}",
                                                      "children": []})
            chain["children"].append(item)
    if parents:
        for item, parent in parents:
            (items[parent]["children"] if parent in items and items[parent] is not item else roots).append(item)
        return [top for top in tops if top["children"]] + roots, "Tree"
    if rounds:
        return list(rounds.values()), "Chain of rounds"
    return [], ""


def _fragment(request: Request) -> bool:
    return request.headers.get("x-console-fragment") == "1"


def _timings(signals: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each signal's time, and its offset from the first; then how long the node ran."""
    first = min((signal["at"] for signal in signals), default=None)
    timings = [(signal["kind"], f"{_when(signal['at'])} (+{_seconds(signal['at'] - first)})"
                if first is not None else _when(signal["at"])) for signal in signals]
    elapsed = next((signal["elapsed"] for signal in reversed(signals) if signal["elapsed"] is not None), None)
    if elapsed is not None:
        timings.append(("ran for", _seconds(elapsed)))
    return timings


def _node_error(record: RunRecord, name: str, node_id: str, state: str, result: Any) -> tuple[Any, Any]:
    """The node's error and its type: as the run recorded it, else a failed node's result."""
    error, error_type = None, None
    run_errors = record.error if isinstance(record.error, Mapping) else {}
    recorded = run_errors.get(name) or run_errors.get(node_id)
    if isinstance(recorded, Mapping):
        error = recorded.get("error") or recorded.get("message") or json.dumps(recorded, default=str)
        error_type = recorded.get("type") or recorded.get("error_type")
    elif recorded is not None:
        error = str(recorded)
    if error is None and state == "failed":
        error = result if isinstance(result, str) else json.dumps(result, indent=2, default=str)
        if isinstance(result, Mapping):
            error_type = result.get("type") or result.get("error_type")
    return error, error_type
