"""The durable record of engine runs: the SQLite ``EventSink`` engines write to, and its reads.

Owns the ``engine_runs`` and ``engine_events`` tables (schema migration 5, in the same
file as the run store: ``OPGRAPH_DB``, default ``~/.opgraph/opgraph.db``): a run's
row with its inputs, configuration, status and statistics, and every typed event and
notification under the run's id, and each status change's outbox event (``engine_run.<status>``,
outbox.py) in the same transaction. It never runs an engine.

The store's errors (``EngineRunNotFoundError`` among them) are drawn in errors.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opgraph.actors.persistence.backends import Connection, Row

from .database import StoreDatabase
from .errors import EngineRunNotFoundError
from .outbox import record
from .owners import ProcessIdentity, owner_is_alive

if TYPE_CHECKING:  # engines load Ray; the store must open without it (`opgraph run show`)
    from opgraph.engines import EventRecord

__all__ = ["ENGINE_RUN_STATUSES", "EngineRunNotFoundError", "EngineRunRecord", "EngineRunStore"]

ENGINE_RUN_STATUSES = ("running", "completed", "degraded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class EngineRunRecord:
    """One engine run row with its JSON columns decoded."""

    run_id: str
    engine: str
    status: str
    inputs: dict[str, Any]
    config: dict[str, Any]
    result: str | None
    degrade_reason: str
    error: Any
    statistics: dict[str, Any] | None
    created_at: float
    finished_at: float | None
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_start: str | None = None


# Named, not ``*``: a PostgreSQL table also has the ``rowid`` that SQLite keeps implicitly.
_ENGINE_RUN = "SELECT " + ", ".join(column.name for column in fields(EngineRunRecord)) + " FROM engine_runs"


def _encode(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)


def _record(row: Row) -> EngineRunRecord:
    values = dict(row)
    for column in ("inputs", "config", "error", "statistics"):
        values[column] = None if values[column] is None else json.loads(values[column])
    return EngineRunRecord(**values)


def _engine_event(db: Connection, run_id: str, engine: str, status: str, at: float,
                  error: Mapping[str, Any] | None = None) -> None:
    """The outbox event of an engine run's transition (``engine_run.<status>``), in its transaction."""
    payload: dict[str, Any] = {"run_id": run_id, "engine": engine, "status": status}
    if error and error.get("error_type"):
        payload["error_type"] = error["error_type"]
    record(db, f"engine_run.{status}", run_id, payload, at=at)


class EngineRunStore(StoreDatabase):
    """The engines' ``EventSink`` on the run store's file; engines call it from worker threads.

    ``path`` is a file, ``":memory:"``, or None for ``default_store_path()``.
    """

    def __init__(self, path: str | Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(path, clock=clock, fsync_every_commit=True)

    # -- the EventSink protocol -------------------------------------------------------------
    def open_run(self, run_id: str, *, engine: str, inputs: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        owner = self._owner
        now = self._clock()
        with self._transaction(write=True) as db:
            db.execute("INSERT INTO engine_runs (run_id, engine, status, inputs, config, created_at, owner_host,"
                       " owner_pid, owner_start) VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                       (run_id, engine, _encode(dict(inputs)), _encode(dict(config)), now,
                        owner.host, owner.pid, owner.start))
            _engine_event(db, run_id, engine, "running", now)

    def record_events(self, run_id: str, records: Sequence[EventRecord]) -> None:
        rows = [(run_id, r.seq, r.kind, r.type, r.agent, _encode(r.data), r.at) for r in records]
        with self._transaction(write=True) as db:
            db.executemany("INSERT INTO engine_events (run_id, seq, kind, type, agent, data, at)"
                           " VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def close_run(self, run_id: str, status: str, *, result: str | None, degrade_reason: str,
                  error: Mapping[str, Any] | None, statistics: Mapping[str, Any]) -> None:
        if status not in ENGINE_RUN_STATUSES[1:]:
            raise ValueError(f"an engine run ends {', '.join(ENGINE_RUN_STATUSES[1:])}, not {status!r}")
        now = self._clock()
        with self._transaction(write=True) as db:
            changed = db.execute(
                "UPDATE engine_runs SET status = ?, result = ?, degrade_reason = ?, error = ?, statistics = ?,"
                " finished_at = ? WHERE run_id = ? AND status = 'running' RETURNING engine",
                (status, result, degrade_reason or "", None if error is None else _encode(dict(error)),
                 _encode(dict(statistics)), now, run_id)).fetchone()
            if changed is None:
                self._get(db, run_id)
            else:
                _engine_event(db, run_id, changed[0], status, now, error)

    # -- reads ---------------------------------------------------------------------------
    def _get(self, db: Connection, run_id: str) -> EngineRunRecord:
        row = db.execute(_ENGINE_RUN + " WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise EngineRunNotFoundError(run_id)
        return _record(row)

    def get_run(self, run_id: str) -> EngineRunRecord:
        """The run's row; a run still 'running' whose owner process on this host died reads as failed."""
        with self._transaction() as db:
            record = self._get(db, run_id)
        if record.status == "running" and record.owner_pid is not None and record.owner_host is not None:
            owner = ProcessIdentity(record.owner_host, record.owner_pid, record.owner_start)
            if owner_is_alive(owner, self._owner) is False:
                error = {"error": f"the process that ran it (pid {record.owner_pid} on {record.owner_host}) "
                                  "exited before the run ended", "error_type": "OwnerProcessLost"}
                now = self._clock()
                with self._transaction(write=True) as db:
                    if db.execute("UPDATE engine_runs SET status = 'failed', error = ?, finished_at = ?"
                                  " WHERE run_id = ? AND status = 'running'", (_encode(error), now, run_id)).rowcount:
                        _engine_event(db, run_id, record.engine, "failed", now, error)
                    record = self._get(db, run_id)
        return record

    def has_run(self, run_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("SELECT 1 FROM engine_runs WHERE run_id = ?", (run_id,)).fetchone() is not None

    def events(self, run_id: str, *, after_seq: int = 0, limit: int | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        """The run's records with ``seq > after_seq``, in order: ``{seq, kind, type, agent, data, at}``."""
        query = "SELECT seq, kind, type, agent, data, at FROM engine_events WHERE run_id = ? AND seq > ?"
        values: list[Any] = [run_id, after_seq]
        if kind is not None:
            query += " AND kind = ?"
            values.append(kind)
        query += " ORDER BY seq"
        if limit is not None:
            query += " LIMIT ?"
            values.append(int(limit))
        with self._transaction() as db:
            self._get(db, run_id)
            rows = db.execute(query, values).fetchall()
        return [{**dict(row), "data": json.loads(row["data"])} for row in rows]

    def list_runs(self, *, engine: str | None = None, limit: int = 50) -> list[EngineRunRecord]:
        query, values = _ENGINE_RUN, []
        if engine is not None:
            query += " WHERE engine = ?"
            values.append(engine)
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        with self._transaction() as db:
            return [_record(row) for row in db.execute(query, (*values, int(limit)))]

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Per-engine totals over every recorded run, in ``engine_statistics()`` shape.

        For an exporter in another process than the engines: runs by status and agents
        made (finished runs), budget exhaustions by reason, missing emissions and judge
        outcomes (from the events).
        """
        totals: dict[str, dict[str, Any]] = {}
        with self._transaction() as db:
            for engine, status, count, agents in db.execute(
                    "SELECT engine, status, COUNT(*), SUM(COALESCE("
                    f"{db.json_number('statistics', 'budget', 'agents_made')}, 0)) FROM engine_runs"
                    " GROUP BY engine, status"):
                entry = totals.setdefault(engine, _empty_totals())
                entry["runs_started"] += count
                entry["agents_made"] += int(agents or 0)  # as the budget counted them, at the run's end
                if status != "running":
                    entry["runs_finished"][status] = count
            rows = db.execute(
                "SELECT r.engine, e.type, e.data FROM engine_events e JOIN engine_runs r ON r.run_id = e.run_id"
                " WHERE e.kind = 'notification' AND e.type IN ('budget_exhausted', 'emission_missing', 'judged')"
            ).fetchall()
        for engine, kind, data in rows:
            entry = totals.setdefault(engine, _empty_totals())
            if kind == "emission_missing":
                entry["emissions_missing"] += 1
            elif kind == "judged":
                outcome = json.loads(data).get("outcome", "unknown")
                entry["judge_outcomes"][outcome] = entry["judge_outcomes"].get(outcome, 0) + 1
            else:
                reason = json.loads(data).get("reason", "unknown")
                entry["budget_exhaustions"][reason] = entry["budget_exhaustions"].get(reason, 0) + 1
        return totals


def _empty_totals() -> dict[str, Any]:
    return {"runs_started": 0, "agents_made": 0, "emissions_missing": 0, "budget_exhaustions": {},
            "judge_outcomes": {}, "runs_finished": {}}
