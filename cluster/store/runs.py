"""Runs of any lane in the run store: provenance, capabilities, lifecycle, signals, node results, branches.

Owns the run rows (ADR-0068 D4 provenance and the D3 capability matrix of the invocation,
as the lane gave them), their legal status transitions, lifecycle signals, each settled
node's result, branch messages, and settling a run whose owner process died. Every status
transition writes its outbox event (outbox.py) in the same transaction. It checks a
provenance payload's shape, never a lane's own rules: the lane checked those before it
asked for a row, and the store records every lane alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from opgraph.actors.persistence.backends import Connection, Row

from .branch_rows import is_prefix_row, prefix_rows, resolve_rows
from .definitions import CONTENT_HASH, Definitions, WorkflowVersion
from .errors import (
    ProvenanceError,
    RunConflictError,
    RunNotFoundError,
    RunNotResumableError,
    WorkflowStoreError,
    WorkflowVersionNotFoundError,
)
from .outbox import run_event
from .owners import ProcessIdentity, owner_is_alive
from .schema import RUN_STATUSES, TERMINAL_RUN_STATUSES, sources_of

__all__ = ["OWNER_LOST_SIGNAL", "OWNER_PROCESS_LOST", "REGISTRY_SOURCE", "RESUMED_SIGNAL", "RunRecord", "RunStore",
           "provenance_columns"]

# The one source kind the store itself resolves: a definition in its own registry, pinned
# to a version (every other kind, a file, a prompt, a playbook, is the lane's to resolve).
REGISTRY_SOURCE = "workflow_def"
# The error type of a run the store settled because its owner process died: an inference,
# not the run's outcome, so it is the one ended run that may be reopened (``reopen_run``).
OWNER_PROCESS_LOST = "OwnerProcessLost"
# A run's own lifecycle beyond its status column, as signals whose node_id is the run's id: the
# store settled it failed because its owner died, and it was reopened to be continued from the
# run log. The row's status goes failed -> running -> completed; these say why.
OWNER_LOST_SIGNAL = "owner_lost"
RESUMED_SIGNAL = "resumed"
# What an undisturbed run records for a node that settled with a status: queued, started (when
# it ran), then the status (``complete_signals`` fills in what a dead owner did not write).
_NODE_SIGNALS = {"completed": ("queued", "started", "completed"), "failed": ("queued", "started", "failed"),
                 "skipped": ("queued", "skipped"), "cancelled": ("queued", "cancelled")}


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run row with its JSON columns decoded (ADR-0068 D4 provenance included)."""

    run_id: str
    session_id: str
    lane: str
    workflow_id: str | None
    workflow_name: str | None
    version: int | None
    content_hash: str | None
    source_kind: str
    source_ref: str
    provenance: dict[str, Any]
    inputs: dict[str, Any]
    status: str
    outputs: Any
    error: Any
    created_at: float
    started_at: float | None
    finished_at: float | None
    # The process running it (see owners.py); None for runs recorded before schema v3,
    # and for runs no process of this host owns (a detached run on the cluster).
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_start: str | None = None
    # The capability matrix this invocation published (ADR-0068 D3), and what its lane
    # needs to present or resume it from another process; None before schema v6.
    capabilities: dict[str, bool] | None = None
    recovery: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES

    @property
    def orphaned(self) -> bool:
        """Recorded failed because its owner process died (and so resumable from the run log)."""
        return self.status == "failed" and isinstance(self.error, dict) and \
            self.error.get("error_type") == OWNER_PROCESS_LOST


def _encode(value: Any) -> str:
    # Outputs, errors and messages may hold non-JSON values; they are stored as their str().
    return json.dumps(value, default=str, sort_keys=True)


def _unreadable_branch(run_id: str) -> Callable[[str, str], Exception]:
    def fail(branch_id: str, why: str) -> Exception:
        return WorkflowStoreError(f"run {run_id}: the recorded messages of branch {branch_id} cannot be read: {why}",
                                  run_id=run_id)
    return fail


_JSON_COLUMNS = ("provenance", "inputs", "outputs", "error", "capabilities", "recovery")
# Named, not ``*``: a PostgreSQL runs table also has the ``rowid`` that SQLite keeps implicitly.
_RUN = "SELECT " + ", ".join(column.name for column in fields(RunRecord)) + " FROM runs"


def _run(row: Row) -> RunRecord:
    values = dict(row)
    for column in _JSON_COLUMNS:
        values[column] = None if values[column] is None else json.loads(values[column])
    return RunRecord(**values)


def provenance_columns(payload: Any) -> tuple[str, str, str, int | None, str | None]:
    """``(lane, source kind, source ref, version, content hash)`` of a D4 payload, or ``ProvenanceError``.

    Only the shape every lane shares is checked here; a lane's own rules (the fixed lane's
    required hash, say) are its adapter's.
    """
    problems: list[str] = []
    if not isinstance(payload, Mapping):
        raise ProvenanceError(f"invalid run provenance: a JSON object is needed, got {type(payload).__name__}")
    lane, source = payload.get("lane"), payload.get("source")
    if not isinstance(lane, str) or not lane:
        problems.append(f"lane: a lane name is needed, got {lane!r}")
    if not isinstance(source, Mapping):
        problems.append(f"source: an object with kind and ref is needed, got {source!r}")
        source = {}
    kind, ref = source.get("kind"), source.get("ref")
    version, content_hash = source.get("version"), source.get("content_hash")
    if not isinstance(kind, str) or not kind:
        problems.append(f"source.kind: a source kind is needed, got {kind!r}")
    if not isinstance(ref, str):
        problems.append(f"source.ref: a reference string is needed, got {ref!r}")
    if version is not None and (type(version) is not int or version < 1):
        problems.append(f"source.version: a version is an integer from 1, got {version!r}")
    if content_hash is not None and not (isinstance(content_hash, str) and CONTENT_HASH.fullmatch(content_hash)):
        problems.append(f"source.content_hash: 'sha256:' and 64 hex digits, got {content_hash!r}")
    if problems:
        raise ProvenanceError("invalid run provenance: " + "; ".join(problems))
    return lane, kind, ref, version, content_hash


def _signal_rows(signals: Iterable[Mapping[str, Any]], now: float) -> list[tuple[Any, ...]]:
    rows = []
    for index, signal in enumerate(signals):
        if not isinstance(signal.get("node_id"), str) or not isinstance(signal.get("kind"), str):
            raise ValueError(f"signal {index} needs string node_id and kind, got {dict(signal)!r}")
        rows.append((signal["node_id"], signal.get("spec_node_id"), signal["kind"],
                     signal.get("elapsed"), signal.get("at", now)))
    return rows


def _check_status(status: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if status not in allowed:
        raise ValueError(f"run status {status!r} is not allowed here; allowed: {', '.join(allowed)}")


class RunStore(Definitions):
    """The lane-agnostic run store: the definition registry (``Definitions``) and runs of any lane."""

    # -- runs --------------------------------------------------------------------------
    def create_run(self, run_id: str, *, session_id: str, provenance: Mapping[str, Any],
                   inputs: Mapping[str, Any] | None, workflow: WorkflowVersion | None = None,
                   status: str = "admitted", capabilities: Mapping[str, bool] | None = None,
                   recovery: Mapping[str, Any] | None = None, owned: bool = True) -> RunRecord:
        """Record a run of any lane; lane and source come from the ``provenance`` payload (D4).

        A ``workflow_def`` source (a definition in this store) needs its pinned
        ``workflow``, and the two must agree on name, version and hash (else
        ``ProvenanceError``); any other source takes none. ``capabilities`` is the
        invocation's matrix (D3), ``recovery`` what the lane needs to present or resume
        the run elsewhere. ``owned=False`` records no owner process: a detached run that
        no process of this host settles, so none is reaped as its orphan. ``status`` is
        ``admitted`` or ``running``; ``inputs=None`` is stored as ``{}``.
        """
        _check_status(status, ("admitted", "running"))
        lane, kind, ref, version, content_hash = provenance_columns(provenance)
        if (kind == REGISTRY_SOURCE) != (workflow is not None):
            raise ProvenanceError(f"a {kind} run {'needs' if workflow is None else 'takes no'} "
                                  "pinned WorkflowVersion")
        if workflow is not None and (workflow.name, workflow.version, workflow.content_hash) != (
                ref, version, content_hash):
            raise ProvenanceError(f"the provenance pins {ref}@{version} ({content_hash}) "
                                  f"but the workflow is {workflow.ref} ({workflow.content_hash})")
        owner = (self._owner.host, self._owner.pid, self._owner.start) if owned else (None, None, None)
        now = self._clock()
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone():
                raise RunConflictError(run_id)
            if workflow is not None and not db.execute(
                    "SELECT 1 FROM workflow_versions WHERE workflow_id = ? AND version = ? AND content_hash = ?",
                    (workflow.workflow_id, workflow.version, workflow.content_hash)).fetchone():
                raise WorkflowVersionNotFoundError(workflow.name, workflow.version)
            db.execute(
                "INSERT INTO runs (run_id, session_id, lane, workflow_id, workflow_name, version, content_hash,"
                " source_kind, source_ref, provenance, inputs, status, created_at, started_at,"
                " owner_host, owner_pid, owner_start, capabilities, recovery)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, str(session_id), lane, workflow and workflow.workflow_id, workflow and workflow.name,
                 version, content_hash, kind, ref, _encode(dict(provenance)), _encode(dict(inputs or {})), status,
                 now, now if status == "running" else None, *owner,
                 None if capabilities is None else _encode(dict(capabilities)),
                 None if recovery is None else _encode(dict(recovery))))
            run_event(db, run_id, status, at=now, lane=lane, source_ref=ref)
            return self._get_run(db, run_id)

    def _check_run(self, db: Connection, run_id: str) -> None:
        """Raise ``RunNotFoundError`` for an unknown run. Not ``_get_run``: every progress write
        checks, and a planned run's record (its plan and labels, for 200 assignments 50 KB of
        JSON) was decoded each time, a fifth of the driver's CPU in the planned benchmark."""
        if db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
            raise RunNotFoundError(run_id)

    def _get_run(self, db: Connection, run_id: str) -> RunRecord:
        row = db.execute(_RUN + " WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        return _run(row)

    def _transition(self, db: Connection, run_id: str, target: str, sets: str,
                    values: tuple[Any, ...], *, error: Any = None) -> bool:
        """Move the run to ``target`` if its status allows it, with its outbox event in this transaction."""
        sources = sources_of(target)
        marks = ", ".join("?" * len(sources))
        changed = db.execute(f"UPDATE runs SET status = ?, {sets} WHERE run_id = ? AND status IN ({marks})"
                             " RETURNING lane, source_ref", (target, *values, run_id, *sources)).fetchone()
        if changed is None:
            self._check_run(db, run_id)  # raises RunNotFoundError for an unknown run
            return False
        run_event(db, run_id, target, at=self._clock(), lane=changed[0], source_ref=changed[1], error=error)
        return True

    def mark_running(self, run_id: str) -> bool:
        """``admitted -> running``; False (and no change) when the run already left ``admitted``."""
        with self._transaction(write=True) as db:
            return self._transition(db, run_id, "running", "started_at = ?", (self._clock(),))

    def finish_run(self, run_id: str, status: str, *, outputs: Any = None, error: Any = None) -> bool:
        """Settle a run as completed, failed or cancelled.

        Terminal statuses are final: finishing a run that already finished returns False
        and changes nothing, so a cancelled run stays cancelled whatever arrives later.
        """
        _check_status(status, sorted(TERMINAL_RUN_STATUSES))
        with self._transaction(write=True) as db:
            return self._transition(db, run_id, status, "outputs = ?, error = ?, finished_at = ?",
                                    (_encode(outputs), _encode(error), self._clock()), error=error)

    def reopen_run(self, run_id: str, *, session_id: str | None = None) -> RunRecord:
        """An orphaned run goes back to ``running``, owned by this process, to be continued from the run log.

        Orphaned means recorded failed with ``OwnerProcessLost`` (a run whose dead owner
        was not yet noticed is settled so first): the store's inference that its process
        died, not the run's outcome, so it is the one way out of an ended status. Any other
        run raises ``RunNotResumableError``.
        """
        self.get_run(run_id)  # settles the run first if its owner died unnoticed (or raises RunNotFoundError)
        with self._transaction(write=True) as db:
            changed = db.execute(
                "UPDATE runs SET status = 'running', outputs = NULL, error = NULL, finished_at = NULL,"
                " owner_host = ?, owner_pid = ?, owner_start = ?, session_id = COALESCE(?, session_id)"
                f" WHERE run_id = ? AND status = 'failed' AND {db.json_text('error', 'error_type')} = ?"
                " RETURNING lane, source_ref",
                (self._owner.host, self._owner.pid, self._owner.start, session_id, run_id,
                 OWNER_PROCESS_LOST)).fetchone()
            if changed is None:
                raise RunNotResumableError(run_id, self._get_run(db, run_id).status)
            run_event(db, run_id, "running", at=self._clock(), lane=changed[0], source_ref=changed[1],
                      event_type="run.resumed")
            self._append_signals(db, run_id, [(run_id, None, RESUMED_SIGNAL, None, self._clock())])
            return self._get_run(db, run_id)

    def get_run(self, run_id: str) -> RunRecord:
        return self._read_runs(lambda db: [self._get_run(db, run_id)])[0]

    def _read_runs(self, read: Callable[[Connection], list[RunRecord]]) -> list[RunRecord]:
        """``read`` the runs; if any is an orphan, settle it as failed and read them again."""
        with self._transaction() as db:
            records = read(db)
        orphans = [record for record in records if self._orphaned(record)]
        if not orphans:
            return records
        for record in orphans:
            self._settle_orphan(record)
        with self._transaction() as db:
            return read(db)

    def reap_orphaned_runs(self) -> list[str]:
        """Settle as failed every unfinished run whose owner process on this host is gone.

        A run executes in the process that admitted it; once that process has died (a
        crash, a kill, a closed terminal) nothing else will settle it. Reads do this for
        the runs they return; this does it for all of them. Returns the run ids settled.
        """
        with self._transaction() as db:
            rows = db.execute(_RUN + " WHERE status IN ('admitted', 'running') AND owner_host = ?",
                              (self._owner.host,)).fetchall()
        return [record.run_id for record in map(_run, rows) if self._orphaned(record) and self._settle_orphan(record)]

    def _orphaned(self, record: RunRecord) -> bool:
        if record.terminal or record.owner_pid is None or record.owner_host is None:
            return False
        owner = ProcessIdentity(record.owner_host, record.owner_pid, record.owner_start)
        return owner_is_alive(owner, self._owner) is False

    def _settle_orphan(self, record: RunRecord) -> bool:
        error = {"error": f"the process that ran it (pid {record.owner_pid} on {record.owner_host}) "
                          "exited before the run settled", "error_type": OWNER_PROCESS_LOST}
        now = self._clock()
        with self._transaction(write=True) as db:
            settled = self._transition(db, record.run_id, "failed", "outputs = ?, error = ?, finished_at = ?",
                                       (_encode(None), _encode(error), now), error=error)
            if settled:  # the run's own signal: why it ended failed (its nodes' signals are as they were)
                self._append_signals(db, record.run_id, [(record.run_id, None, OWNER_LOST_SIGNAL, None, now)])
            return settled

    def list_runs(self, *, workflow: str | None = None, status: str | None = None, lane: str | None = None,
                  limit: int = 50, offset: int = 0) -> list[RunRecord]:
        """Newest first. ``workflow`` matches a workflow id, the name a run was recorded
        under (deleted workflows included), or a file run's path; ``lane`` a lane kind."""
        if status is not None:
            _check_status(status, RUN_STATUSES)
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        query, values = _RUN + " WHERE 1 = 1", []
        if workflow is not None:
            query += " AND ? IN (workflow_id, workflow_name, source_ref)"
            values.append(workflow.strip())
        if status is not None:
            query += " AND status = ?"
            values.append(status)
        if lane is not None:
            query += " AND lane = ?"
            values.append(lane)
        if type(offset) is not int or offset < 0:
            raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?"
        return self._read_runs(lambda db: [_run(row) for row in db.execute(query, (*values, limit, offset))])

    # -- as a run goes -------------------------------------------------------------------
    def record_signals(self, run_id: str, signals: Iterable[Mapping[str, Any]]) -> int:
        """Append lifecycle signals in one transaction; return the last ``seq`` of the run.

        Each signal needs ``node_id`` and ``kind``; ``spec_node_id`` and ``elapsed`` may be
        absent, and ``at`` defaults to now. ``seq`` is assigned here, increasing per run.
        """
        rows = _signal_rows(signals, self._clock())
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            return self._append_signals(db, run_id, rows)

    @staticmethod
    def _append_signals(db: Connection, run_id: str, rows: list[tuple[Any, ...]]) -> int:
        last = db.execute("SELECT COALESCE(MAX(seq), 0) FROM run_signals WHERE run_id = ?", (run_id,)).fetchone()[0]
        db.executemany("INSERT INTO run_signals (run_id, seq, node_id, spec_node_id, kind, elapsed, at)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?)",
                       [(run_id, last + offset, *row) for offset, row in enumerate(rows, start=1)])
        return last + len(rows)

    def record_progress(self, run_id: str, *, signals: Iterable[Mapping[str, Any]] = (),
                        nodes: Iterable[Mapping[str, Any]] = ()) -> int:
        """Append lifecycle signals and record settled nodes in one transaction; return the last ``seq``.

        Signals are as for ``record_signals``. Each node needs ``node_id`` and ``status``;
        ``spec_node_id``, ``result`` (any JSON value) and ``settled_at`` (default now) may
        be given. A node recorded again (a retried attempt) replaces its earlier record.
        """
        now = self._clock()
        signal_rows = _signal_rows(signals, now)
        node_rows = []
        for index, node in enumerate(nodes):
            if not isinstance(node.get("node_id"), str) or not isinstance(node.get("status"), str):
                raise ValueError(f"node {index} needs string node_id and status, got {dict(node)!r}")
            node_rows.append((run_id, node["node_id"], node.get("spec_node_id"), node["status"],
                              _encode(node.get("result")), node.get("settled_at", now)))
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            last = self._append_signals(db, run_id, signal_rows)
            db.executemany("INSERT INTO run_nodes (run_id, node_id, spec_node_id, status, result, settled_at)"
                           " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, node_id) DO UPDATE SET"
                           " status = excluded.status, result = excluded.result, settled_at = excluded.settled_at,"
                           " spec_node_id = excluded.spec_node_id", node_rows)
            return last

    def complete_signals(self, run_id: str, statuses: Mapping[str, str], labels: Mapping[str, str]) -> int:
        """Record the lifecycle signals a settled node lacks; return how many were added.

        ``statuses`` maps node ids to how each settled (an envelope's ``operation_statuses``),
        ``labels`` node ids to the lane's names for them. A run resumed after its owner died
        has nodes that settled in the run log while the owner's writes to this store were
        still on their way: they get what an undisturbed run records for them (queued,
        started when they ran, then their status), so the record is as complete.
        """
        now = self._clock()
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            seen: dict[str, set[str]] = {}
            for row in db.execute("SELECT node_id, kind FROM run_signals WHERE run_id = ?", (run_id,)):
                seen.setdefault(row[0], set()).add(row[1])
            rows = [(node_id, labels.get(node_id), kind, None, now)
                    for node_id, status in statuses.items()
                    for kind in _NODE_SIGNALS.get(status, ()) if kind not in seen.get(node_id, ())]
            self._append_signals(db, run_id, rows)
            return len(rows)

    def run_nodes(self, run_id: str) -> list[dict[str, Any]]:
        """``[{node_id, spec_node_id, status, result, settled_at}]`` of the settled nodes, in settle order."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            rows = db.execute("SELECT node_id, spec_node_id, status, result, settled_at FROM run_nodes"
                              " WHERE run_id = ? ORDER BY settled_at, rowid", (run_id,))
            return [{**dict(row), "result": json.loads(row["result"])} for row in rows]

    def record_outline(self, run_id: str, outline: Mapping[str, Any]) -> None:
        """Record the run's graph outline once, as it starts: ``{"nodes": [[node_id, name, operation], ...],
        "edges": [[from_id, to_id], ...]}``. Recording it again replaces it (a resumed run's graph)."""
        nodes, edges = outline.get("nodes"), outline.get("edges")
        if not isinstance(nodes, list | tuple) or not isinstance(edges, list | tuple):
            raise ValueError(f"a graph outline of run {run_id} needs lists 'nodes' and 'edges'")
        encoded = json.dumps({"nodes": [list(node) for node in nodes], "edges": [list(edge) for edge in edges]},
                             default=str)
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            db.execute("INSERT INTO run_outlines (run_id, outline) VALUES (?, ?)"
                       " ON CONFLICT (run_id) DO UPDATE SET outline = excluded.outline", (run_id, encoded))

    def run_outline(self, run_id: str) -> dict[str, Any] | None:
        """The run's recorded graph outline (``record_outline``), or None when it recorded none."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            row = db.execute("SELECT outline FROM run_outlines WHERE run_id = ?", (run_id,)).fetchone()
            return None if row is None else json.loads(row[0])

    def node_summary(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """``{run_id: {"counts": {status: settled nodes}, "tokens": int, "cost_usd": float}}`` for each of
        ``run_ids`` that has settled nodes (tokens and cost from each result's ``usage``, where it has one)."""
        run_ids = list(run_ids)
        summary: dict[str, dict[str, Any]] = {}
        if not run_ids:
            return summary
        with self._transaction() as db:
            tokens, cost = db.json_number("result", "usage", "total_tokens"), db.json_number("result", "usage",
                                                                                            "cost_usd")
            for start in range(0, len(run_ids), 500):
                part = run_ids[start:start + 500]
                marks = ", ".join("?" * len(part))
                for row in db.execute(f"SELECT run_id, status, COUNT(*), SUM({tokens}), SUM({cost}) FROM run_nodes"
                                      f" WHERE run_id IN ({marks}) GROUP BY run_id, status", part):
                    entry = summary.setdefault(row[0], {"counts": {}, "tokens": 0, "cost_usd": 0.0})
                    entry["counts"][row[1]] = row[2]
                    entry["tokens"] += int(row[3] or 0)
                    entry["cost_usd"] += float(row[4] or 0)
        return summary

    def node_states(self, run_id: str) -> dict[str, str]:
        """``{node_id: state}``: each node's last lifecycle signal (queued, started, ...), overridden by its
        settled status where it settled; cheap enough for a 10,000-node run's page."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            states = {row[0]: row[1] for row in db.execute(
                "SELECT node_id, kind FROM run_signals WHERE run_id = ? ORDER BY seq", (run_id,))}
            states.update((row[0], row[1]) for row in db.execute(
                "SELECT node_id, status FROM run_nodes WHERE run_id = ?", (run_id,)))
        states.pop(run_id, None)  # the run's own signals (owner_lost, resumed)
        return states

    def run_node(self, run_id: str, node_id: str) -> dict[str, Any] | None:
        """One settled node's record (``run_nodes``), or None when it has not settled."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            row = db.execute("SELECT node_id, spec_node_id, status, result, settled_at FROM run_nodes"
                             " WHERE run_id = ? AND node_id = ?", (run_id, node_id)).fetchone()
            return None if row is None else {**dict(row), "result": json.loads(row["result"])}

    def node_signals(self, run_id: str, node_id: str) -> list[dict[str, Any]]:
        """The signals of one node of the run, in ``seq`` order."""
        with self._transaction() as db:
            rows = db.execute("SELECT seq, node_id, spec_node_id, kind, elapsed, at FROM run_signals"
                              " WHERE run_id = ? AND node_id = ? ORDER BY seq", (run_id, node_id))
            return [dict(row) for row in rows]

    def run_signals(self, run_id: str, after_seq: int = 0) -> list[dict[str, Any]]:
        """The run's signals with ``seq > after_seq``, in ``seq`` order (poll with the last seq seen)."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            rows = db.execute("SELECT seq, node_id, spec_node_id, kind, elapsed, at FROM run_signals"
                              " WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, after_seq))
            return [dict(row) for row in rows]

    def record_branch(self, run_id: str, branch_id: str, *, node_id: str | None = None,
                      messages: Iterable[Any]) -> None:
        """Insert or replace one branch's messages; a None ``node_id`` keeps the recorded one."""
        encoded = _encode(list(messages))
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            self._detach(db, run_id, [branch_id])
            db.execute("INSERT INTO run_branches (run_id, branch_id, node_id, messages) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT (run_id, branch_id) DO UPDATE SET messages = excluded.messages,"
                       " node_id = COALESCE(excluded.node_id, run_branches.node_id)",
                       (run_id, branch_id, node_id, encoded))

    def record_branches(self, run_id: str, branches: Iterable[tuple[str, str | None, Iterable[Any]]]) -> None:
        """``record_branch`` for each ``(branch_id, node_id, messages)``, in one transaction (a run's
        hundreds of clones are recorded at its end: one commit, not one each). A branch that begins
        with the messages of the one before it is written as their prefix and its own tail
        (branch_rows.py): 500 clones of a 200-message branch are 200 messages and 500 tails."""
        rows = [(run_id, *row) for row in prefix_rows([(branch_id, node_id, list(messages))
                                                       for branch_id, node_id, messages in branches], _encode)]
        with self._transaction(write=True) as db:
            self._check_run(db, run_id)
            self._detach(db, run_id, [row[1] for row in rows])
            db.executemany("INSERT INTO run_branches (run_id, branch_id, node_id, messages) VALUES (?, ?, ?, ?)"
                           " ON CONFLICT (run_id, branch_id) DO UPDATE SET messages = excluded.messages,"
                           " node_id = COALESCE(excluded.node_id, run_branches.node_id)", rows)

    def _detach(self, db: Connection, run_id: str, branch_ids: list[str]) -> None:
        """Before rows of ``branch_ids`` are replaced: the run's rows recorded as a prefix of one of
        them are written out as their own lists, so that what they hold stays what it was."""
        held = {row["branch_id"] for row in db.execute("SELECT branch_id FROM run_branches WHERE run_id = ?",
                                                       (run_id,))}
        replaced = held.intersection(branch_ids)
        if not replaced:
            return  # new rows only (a run's branches at its end, its roles': the common case)
        columns = {row["branch_id"]: json.loads(row["messages"]) for row in db.execute(
            "SELECT branch_id, messages FROM run_branches WHERE run_id = ?", (run_id,))}
        dependents = [branch_id for branch_id, value in columns.items()  # those replaced too need nothing
                      if is_prefix_row(value) and value["from"] in replaced and branch_id not in branch_ids]
        if not dependents:
            return
        resolved = resolve_rows(columns, _unreadable_branch(run_id))
        db.executemany("UPDATE run_branches SET messages = ? WHERE run_id = ? AND branch_id = ?",
                       [(_encode(resolved[branch_id]), run_id, branch_id) for branch_id in dependents])

    def run_branches(self, run_id: str) -> list[dict[str, Any]]:
        """``[{branch_id, node_id, messages}]`` in the order branches were first recorded."""
        with self._transaction() as db:
            self._check_run(db, run_id)
            rows = [(r["branch_id"], r["node_id"], json.loads(r["messages"])) for r in db.execute(
                "SELECT branch_id, node_id, messages FROM run_branches WHERE run_id = ? ORDER BY rowid", (run_id,))]
        if any(is_prefix_row(value) for _, _, value in rows):
            resolved = resolve_rows({branch_id: value for branch_id, _, value in rows}, _unreadable_branch(run_id))
            rows = [(branch_id, node_id, resolved[branch_id]) for branch_id, node_id, _ in rows]
        return [{"branch_id": branch_id, "node_id": node_id, "messages": messages}
                for branch_id, node_id, messages in rows]
