"""The durable run log: what a run records as it goes, and how a FlowState is rebuilt from it.

Owns the record vocabulary and the rebuild. A durable FlowState records every fact that
changed it (an outcome, a condition verdict, a control, an undelivered attempt) and every
admission decision (a request key seen, a child admitted with its operation, a drop),
one batch per ``handle()`` call (``AppendRecords``). ``FlowState.rebuild`` replays the
batches through ``handle`` in the same grouping, so the rebuilt state is the state the run
had: node builders are never called again (their children are restored as they were),
and ``recover()`` sends the attempts that were in flight again, each as a new attempt.
A mixin of FlowState: the replay flag and the pending records it keeps are declared there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from . import events as ev
from .errors import OperationError
from .graph import Operation
from .states import EVALUATING, RUNNING

__all__ = ["RECORD_KINDS", "DurableRecords", "hashable_key"]

# Every record is a tuple whose first item is one of these tags:
#   ("finished", now, node_id, attempt, status, response, error, error_type)
#   ("conditions", now, node_id, results, error)
#   ("undelivered", now, node_id, attempt, reason)
#   ("pause", now) ("resume", now) ("message", now, text, ts) ("cancel", now, reason) ("grace", now)
#   ("seen", key)                         a request's de-duplication key, first sighting
#   ("admitted", now, operation, after, emitter_id, assignee, independent)
#   ("dropped", entry)                    a dropped_spawns entry
#   ("escalated", emitter_id)             the emitter was recorded in escalated_operations
#   ("released", now, node_ids)           settled nodes let go (release.py)
#   ("close", now)                        a run kept open takes no more admissions (release.py)
RECORD_KINDS = frozenset({"finished", "conditions", "undelivered", "pause", "resume", "message", "cancel",
                          "grace", "seen", "admitted", "dropped", "escalated", "released", "close"})
_DECISIONS = frozenset({"seen", "admitted", "dropped", "escalated"})


def hashable_key(key: Any) -> Any:
    """A de-duplication key as it was recorded: lists that came back from the log become tuples."""
    if isinstance(key, list):
        return tuple(hashable_key(part) for part in key)
    return key


class DurableRecords:
    """Recording, rebuild and recovery, mixed into FlowState.

    Its flags (``durable``, ``_replaying``, ``_pending_records``) are declared on FlowState
    with the rest of the run's state."""

    def _record(self, *record: Any) -> None:
        if self.durable and not self._replaying:
            self._pending_records.append(record)

    @classmethod
    def rebuild(cls, graph: Any, batches: Iterable[Sequence[Sequence[Any]]], *, started_at: float = 0.0,
                **options: Any) -> Any:
        """The state a run had after ``batches`` (its log), rebuilt on ``graph`` as submitted.

        ``options`` are the run's FlowState options. The graph must be the one the run
        started with: children admitted later are restored from their records. The
        rebuilt state records nothing it replays; call ``recover()`` next.
        """
        state = cls(graph, **options)
        state._replaying = True
        try:
            state.handle(ev.FlowStarted(now=started_at))
            for batch in batches:
                state.handle(*(_event_of(record) for record in batch))
        finally:
            state._replaying = False
        return state

    def recover(self, now: float) -> list[Any]:
        """After a rebuild: every attempt that was in flight goes out again as a new attempt.

        Outcomes of those attempts may have been lost with the process that was to
        receive them, so none counts as settled; each node is dispatched again (attempt
        + 1, a new idempotency key). Async edge conditions that were being evaluated are
        asked for again. A run the log shows settled yields its ``FinishRun`` again.
        Returns the instructions, records of the recovery included.
        """
        if self.finished:  # the log ends with the run settled: only its envelope is left to deliver
            return [ev.FinishRun(self.envelope())]
        # Each goes back to the queue as undelivered, which has an inheriting node take its
        # primary's history again (``_on_undelivered``): the log says the attempt went out, not
        # that its branch had taken that history first.
        lost = [ev.DispatchUndelivered(now, node_id, attempt, "the executor that ran it was replaced")
                for node_id, (attempt, _, _) in self.running.items()]
        out = self.handle(*lost)
        evaluating = [node_id for node_id, state in self.state.items() if state == EVALUATING]
        if evaluating:
            self._out = out
            for node_id in evaluating:
                self._out.append(self._evaluation_request(node_id))
            self._out = []
        return out

    def _on_restored(self, event: ev.Restored) -> None:
        if not self._replaying:
            raise OperationError("a Restored event comes only from the run log, while rebuilding")
        record = event.record
        kind = record[0]
        if kind == "seen":
            self._seen_requests.add(hashable_key(record[1]))
        elif kind == "admitted":
            _, _, operation, after, emitter_id, assignee, independent = record
            self._accept(_as_operation(operation), after, emitter_id, assignee, independent)
        elif kind == "dropped":
            self.dropped_spawns.append(dict(record[1]))
        elif kind == "escalated":
            self.escalated_operations.append(record[1])
        else:
            raise OperationError(f"unknown admission record {kind!r}")

    def pending_running(self) -> list[str]:
        """Nodes in flight (for a shell deciding what a recovery re-sends)."""
        return [node_id for node_id, state in self.state.items() if state == RUNNING]


def _as_operation(value: Any) -> Operation:
    if isinstance(value, Operation):
        return value
    if isinstance(value, dict):
        return Operation.model_validate(value)
    raise OperationError(f"an admitted child must be an Operation, got {type(value).__name__}")


def _event_of(record: Sequence[Any]) -> Any:
    """The event that, handled again, has the effect ``record`` describes."""
    kind = record[0]
    if kind == "finished":
        _, now, node_id, attempt, status, response, error, error_type = record
        return ev.OperationFinished(now, node_id, attempt, status, response, error, error_type, (), True)
    if kind == "conditions":
        _, now, node_id, results, error = record
        return ev.ConditionsEvaluated(now, node_id, tuple((edge, bool(passed)) for edge, passed in results), error)
    if kind == "undelivered":
        _, now, node_id, attempt, reason = record
        return ev.DispatchUndelivered(now, node_id, attempt, reason)
    if kind == "pause":
        return ev.PauseRequested(record[1])
    if kind == "resume":
        return ev.ResumeRequested(record[1])
    if kind == "message":
        return ev.OperatorMessageReceived(record[1], record[2], record[3])
    if kind == "cancel":
        return ev.CancelRequested(record[1], record[2])
    if kind == "grace":
        return ev.CancelGraceExpired(record[1])
    if kind == "released":
        return ev.ReleaseRequested(record[1], tuple(record[2]))
    if kind == "close":
        return ev.CloseRequested(record[1])
    if kind in _DECISIONS:
        return ev.Restored(record[1] if kind == "admitted" else 0.0, tuple(record))
    raise OperationError(f"unknown run-log record {kind!r}")
