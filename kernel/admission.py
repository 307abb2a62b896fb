"""Reactive admission: the one path by which a running graph grows (ADR-0023 D6, ADR-0033 D3).

Owns spawn, escalation and injection handling: request de-duplication, routing through
the node builder, the cap, insertion, edges, cycle rollback and the dropped-spawn ledger.
A mixin of FlowState: it keeps no state of its own and is reached only through ``handle``.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel

from . import events as ev
from . import signals as sig
from .contracts import EscalationRequest, request_problem
from .events import new_record as _new_record
from .graph import Operation
from .states import TERMINAL

__all__ = ["BUILDER_ERROR_CHARS", "SPAWN_INSTRUCTION_CHARS", "ReactiveAdmission"]

BUILDER_ERROR_CHARS = 500
_ESCALATION_IDS = uuid.UUID("5f0c3a5e-8c1d-4d0e-9a57-0b2f6e1d7c41")  # namespace of escalation children's ids
SPAWN_INSTRUCTION_CHARS = 512


class ReactiveAdmission:
    """Spawn, escalation and inject handlers plus ``_accept``, mixed into FlowState."""

    def _on_spawn(self, event: ev.SpawnRequested) -> None:
        if not self.reactive or self.finished or self.cancelling:
            return
        request, emitter_id = event.request, event.emitter_id
        emitter = self.graph.nodes.get(emitter_id) if emitter_id else None
        # Sightings first, validity second: an invalid request sent live arrives again in its
        # emitter's outcome, and must make one ledger entry, not two (issue #32: 1,000 made 1,801).
        if self._is_duplicate_request(event):
            if not event.redelivery:
                self._drop("duplicate", _recordable_assignee(request), emitter_id)
            return
        problem = request_problem(request, self.spawn_type)
        if problem is not None:  # never routed, never admitted, and the run goes on
            self._drop("invalid_request", None, emitter_id, error=problem)
            return
        assignee = _attribute(request, "assignee")
        try:
            child = self.node_builder(request, emitter)
        except Exception as exc:  # noqa: BLE001 - user routing code: becomes a ledger entry, never a crash
            self._drop("builder_error", assignee, emitter_id, error=_text(exc, BUILDER_ERROR_CHARS))
            return
        if child is None:
            self._drop("null_child", assignee, emitter_id)
            return
        independent = bool(_attribute(request, "independent"))
        self._accept(child, None if independent or emitter is None else emitter_id, emitter_id, assignee, independent)

    def _on_escalation(self, event: ev.EscalationRequested) -> None:
        if not self.reactive or self.finished or self.cancelling:
            return
        request = event.request
        if self._is_duplicate_request(event):  # first, as for a spawn
            if not event.redelivery:
                self._drop("duplicate", None, event.emitter_id)
            return
        problem = request_problem(request, EscalationRequest)
        if problem is not None:
            self._drop("invalid_request", None, event.emitter_id, error=problem)
            return
        emitter = self.graph.nodes.get(event.emitter_id) if event.emitter_id else None
        if emitter is not None:
            self.escalated_operations.append(emitter.id)
            self._record("escalated", emitter.id)
        child_id = None
        if _attribute(request, "route") == "higher_tier" and emitter is not None:
            parameters = dict(emitter.parameters)
            parameters.pop("context", None)
            original = parameters.get("instruction", "")
            parameters["instruction"] = (
                f"[ESCALATION] The previous attempt escalated this task to a higher tier. "
                f"Reason: {_attribute(request, 'reason') or ''}\n\n{original}"
            )
            # A deterministic id: the same escalation admitted again (a rebuilt run) is the same node.
            count = self._escalations.get(emitter.id, 0) + 1
            self._escalations[emitter.id] = count
            child = Operation(id=str(uuid.uuid5(_ESCALATION_IDS, f"{self.run_id}/{emitter.id}/{count}")),
                              operation=emitter.operation, parameters=parameters)
            child.metadata["escalated_from"] = emitter.id
            if self._accept(child, None, emitter.id, None, True):
                child_id = child.id
        self._out.append(
            ev.EmitSignal(
                sig.NodeEscalated,
                fields={
                    "run_id": self.run_id,
                    "op_id": event.emitter_id or "",
                    "route": _text(_attribute(request, "route") or "", SPAWN_INSTRUCTION_CHARS),
                    "reason": _text(_attribute(request, "reason") or "", SPAWN_INSTRUCTION_CHARS),
                    "child_id": child_id,
                },
            )
        )

    def _on_inject(self, event: ev.InjectRequested) -> None:
        if not self.reactive or not self.started or self.finished or self.cancelling:
            self._out.append(ev.AdmissionDecided(event.token, False, None, "not_running"))
            return
        operation = event.operation
        if not isinstance(operation, Operation):
            self._out.append(ev.AdmissionDecided(event.token, False, None, "builder_error"))
            return
        if event.after is not None and event.after not in self.graph:
            self._drop("builder_error", None, event.after, op_id=operation.id, error="inject after an unknown node")
            self._out.append(ev.AdmissionDecided(event.token, False, operation.id, "builder_error"))
            return
        accepted = self._accept(operation, None if event.independent else event.after, event.after, None,
                                event.independent)
        reason = None if accepted else self.dropped_spawns[-1]["reason"]
        self._out.append(ev.AdmissionDecided(event.token, accepted, operation.id, reason))

    def _is_duplicate_request(self, event: ev.SpawnRequested | ev.EscalationRequested) -> bool:
        key = event.dedupe_key
        if key is None:
            request = event.request
            try:
                body = request.model_dump_json() if isinstance(request, BaseModel) else repr(request)
            except Exception:  # noqa: BLE001 - a request that will not serialise has no content to compare
                return False
            key = ("content", event.emitter_id, type(request).__name__, body)
        if key in self._seen_requests:
            return True
        self._seen_requests.add(key)
        self._record("seen", key)
        return False

    def _drop(self, reason: str, assignee: Any, emitter_id: str | None, **extra: Any) -> None:
        entry = {"reason": reason, "assignee": assignee, "emitter_id": emitter_id}
        entry.update(extra)
        self.dropped_spawns.append(entry)
        self._record("dropped", entry)

    def _accept(self, child: Operation, after: str | None, emitter_id: str | None, assignee: Any,
                independent: bool) -> bool:
        """The one admission path: cap, duplicate, insertion, edge, cycle rollback, ledger.

        A spawn admits a node per request, so lookups are bound once and records built
        positionally. A child is new to the graph, so its dependencies are the emitter
        it follows (if any) plus any aggregation sources its builder set.
        """
        child_id = child.id
        if self.spawn_count >= self.max_spawn:
            self._drop("max_spawn_exceeded", assignee, emitter_id, op_id=child_id)
            return False
        graph = self.graph
        if child_id in graph.nodes:
            # Ideal over retrospective (ADR-0023 delta 7): reinjection is idempotent.
            self._drop("duplicate", assignee, emitter_id, op_id=child_id)
            return False
        graph.add_node(child)
        metadata = child.metadata
        if after is not None:
            edge = graph.add_edge(after, child_id, label=["spawn"])
            # A node new to the graph has no out-edges, so no path leads back from it:
            # the walk runs only should a builder ever hand over a node that has some.
            if graph._out[child_id] and graph.reaches(child_id, after):
                graph.remove_edge(edge.id)
                graph.remove_node(child_id)
                self._drop("cycle", assignee, emitter_id, op_id=child_id)
                return False
            metadata["parent_id"] = after
            deps = [after]
        else:
            deps = []
        self._record("admitted", self.now, child, after, emitter_id, assignee, independent)
        self.spawn_count += 1
        self.spawned_ids[child_id] = None
        metadata["spawned"] = True
        if metadata.get("aggregation_sources"):
            deps = self._dependencies_of(child)

        # Registration: waiting on its unsettled dependencies, ranked after its emitter.
        if "weight" in child.metadata:
            self.weighted = True
        unsettled = self._register(child_id, deps)
        ranks = self._ranks()
        emitter_rank = ranks.get(emitter_id) if emitter_id is not None else None
        if emitter_rank is None:  # injected on its own: after everything, in order of arrival
            self._injected += 1
            ranks[child_id] = (len(graph.nodes) + 1_000_000_000 + self._injected,)
        else:  # spawned children rank right after their emitter, in per-emitter order
            count = self._children.get(emitter_id, 0)
            self._children[emitter_id] = count + 1
            ranks[child_id] = (*emitter_rank, count)

        if child.status in TERMINAL:
            # Injected already settled: it short-circuits like a restored node (ADR-0023
            # D5, which D6's injections share) and is never invoked.
            self._restore(child)
            self._release_dependents(child_id)
            return True

        # Its own branch (ADR-0023 D6), cloned from a known branch it names, else from its
        # emitter's for a dependent spawn, else from the session's default branch. Beyond the
        # record: a ``stateless`` operation (a dataset job's row, which reads no history and
        # writes none) runs with no branch, so a million rows leave no clone behind.
        if metadata.get("stateless"):
            self.branch[child_id] = None
        else:
            branch_id = child.branch_id
            if self._branch_is_known(branch_id):
                source = branch_id
            elif after is not None:
                source = self.branch.get(after, self.default_branch_id)
            else:
                source = self.clone_source_branch_id
            self._clone_branch(child_id, source, reactive=True)
        out, record, signal = self._out.append, _new_record, ev.EmitSignal
        if self.progress_signals:
            instruction = child.parameters.get("instruction")
            fields = {
                "run_id": self.run_id,
                "op_id": child_id,
                "parent_id": after,
                "independent": independent,
                "assignee": assignee,
                "instruction": None if instruction is None else _text(instruction, SPAWN_INSTRUCTION_CHARS),
            }
            out(record(signal, (sig.NodeSpawned, "", None, 0.0, (), fields)))
            out(record(signal, (sig.NodeQueued, self.run_id, child, self._elapsed, deps, None)))
        if unsettled == 0:
            self._gate(child_id)
        return True


def _recordable_assignee(request: Any) -> str | None:
    """The assignee of a request not yet validated, for a ledger entry: a string within bounds, else None
    (an invalid request's field may be anything, and the ledger is encoded into the run log)."""
    assignee = _attribute(request, "assignee")
    return assignee if type(assignee) is str and len(assignee) <= SPAWN_INSTRUCTION_CHARS else None


def _attribute(value: Any, name: str) -> Any:
    """``getattr(value, name, None)`` for a user object whose attribute may raise: None then."""
    try:
        return getattr(value, name, None)
    except Exception:  # noqa: BLE001 - user code behind the attribute; the request was validated already
        return None


def _text(value: Any, limit: int) -> str:
    """``str(value)`` cut to ``limit`` characters, for a ledger entry or a signal field.

    The value comes from user code (a request, a builder's parameters, an exception),
    and its ``__str__`` raising must not stop an admission half way."""
    try:
        return str(value)[:limit]
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__} that cannot be shown>"
