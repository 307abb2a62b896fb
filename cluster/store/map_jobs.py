"""Dataset jobs in the run store: each job, and each input row's answer, recorded once.

Owns the ``map_jobs`` and ``map_rows`` tables (schema migration 7): a job found again by
the command that made it and pinned to its input's content hash; which process runs it
(one at a time: a claim is refused while its owner lives); and each row's outcome, keyed by
the row's id, with its usage and cost, written before the row counts as done. Reads come
in pages (by the row's place in the input), so an export of a million rows never holds
them all. It runs nothing and reads no input: opgraph.cluster.jobs does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from json.encoder import encode_basestring
from typing import Any, NamedTuple

from opgraph.actors.persistence.backends import Connection, Row

from .errors import MapJobBusyError, MapJobNotFoundError, WorkflowStoreError
from .owners import ProcessIdentity, owner_is_alive
from .runs import RunStore

__all__ = ["MAP_JOB_STATUSES", "ROW_STATUSES", "MapJobRecord", "MapJobStore", "RowOutcome"]

MAP_JOB_STATUSES = ("running", "completed", "stopped", "failed", "cancelled")
ROW_STATUSES = ("done", "failed")
PAGE_ROWS = 5000  # rows one read of a page brings back
KEYS_PER_QUERY = 500  # row keys one lookup names (SQLite's parameter limit is far above)


@dataclass(frozen=True, slots=True)
class MapJobRecord:
    """One job row with its JSON columns decoded. ``spec`` is what shapes an answer (prompt,
    model, schema, workflow, id column); ``run_id`` the run it feeds or fed last."""

    job_id: str
    command_key: str
    input_ref: str
    input_hash: str
    spec: dict[str, Any]
    rows_total: int | None
    run_id: str | None
    runs: int
    status: str
    summary: dict[str, Any] | None
    created_at: float
    updated_at: float
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_start: str | None = None

    @property
    def owner(self) -> ProcessIdentity | None:
        if self.owner_host is None or self.owner_pid is None:
            return None
        return ProcessIdentity(self.owner_host, self.owner_pid, self.owner_start)


class RowOutcome(NamedTuple):
    """One input row's recorded answer: ``done`` with its ``answer``, or ``failed`` with its ``error``.

    ``answer_json`` is the answer as JSON text when the caller has it already (a row's answer
    arrives so from its worker): stored and exported as it is, never encoded again. A named
    tuple, as a job makes one per row."""

    row_key: str
    ordinal: int
    status: str
    answer: Any = None
    error: str | None = None
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    model: str | None = None
    run_id: str | None = None
    answer_json: str | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_record(self) -> dict[str, Any]:
        """The row as its export line says it (the output file holds one per row)."""
        record: dict[str, Any] = {"id": self.row_key, "status": self.status}
        if self.status == "done":
            record["answer"] = self.answer if self.answer_json is None else json.loads(self.answer_json)
        else:
            record["error"] = self.error
        record["usage"] = {"calls": self.calls, "prompt_tokens": self.prompt_tokens,
                           "completion_tokens": self.completion_tokens}
        record["cost_usd"] = self.cost_usd
        if self.model:
            record["model"] = self.model
        return record

    def as_line(self) -> str:
        """``as_record`` as one JSON line, built around the answer's JSON text (not encoded again)."""
        dumps = _compact
        body = (f',"answer":{self.answer_json if self.answer_json is not None else dumps(self.answer)}'
                if self.status == "done" else f',"error":{dumps(self.error)}')
        model = f',"model":{dumps(self.model)}' if self.model else ""
        return (f'{{"id":{dumps(self.row_key)},"status":"{self.status}"{body},"usage":{{"calls":{self.calls},'
                f'"prompt_tokens":{self.prompt_tokens},"completion_tokens":{self.completion_tokens}}},'
                f'"cost_usd":{self.cost_usd!r}{model}}}\n')


def _compact(value: Any) -> str:
    if type(value) is str:  # a row's key, its model, its error: what json.dumps makes of it, without its setup
        return encode_basestring(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


_JOB = "SELECT " + ", ".join(column.name for column in fields(MapJobRecord)) + " FROM map_jobs"
_INSERT_ROW = ("INSERT INTO map_rows (job_id, row_key, ordinal, status, answer, error, calls, prompt_tokens,"
               " completion_tokens, cost_usd, model, run_id, recorded_at)"
               " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_ROW_COLUMNS = ("row_key", "ordinal", "status", "answer", "error", "calls", "prompt_tokens", "completion_tokens",
                "cost_usd", "model", "run_id")


def _job(row: Row) -> MapJobRecord:
    values = dict(row)
    values["spec"] = json.loads(values["spec"])
    values["summary"] = None if values["summary"] is None else json.loads(values["summary"])
    return MapJobRecord(**values)


def _row(row: Row) -> RowOutcome:
    """A stored row, its answer kept as the JSON text it is stored as (an export writes it as it is)."""
    values = dict(row)
    values["answer_json"], values["answer"] = values["answer"], None
    return RowOutcome(**values)


def _encode(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True, ensure_ascii=False)


class MapJobStore(RunStore):
    """The dataset jobs of one run store (``path``: a file, ``":memory:"``, a PostgreSQL URL or None),
    with the store's runs: a job's run is recorded there like any lane's."""

    # -- jobs ------------------------------------------------------------------------------------
    def latest_job(self, command_key: str) -> MapJobRecord | None:
        """The newest job the command ``command_key`` made, or None."""
        with self._transaction() as db:
            row = db.execute(_JOB + " WHERE command_key = ? ORDER BY created_at DESC LIMIT 1",
                             (command_key,)).fetchone()
        return None if row is None else _job(row)

    def find_job(self, job_id: str) -> MapJobRecord | None:
        """The job ``job_id`` exactly, or None."""
        with self._transaction() as db:
            return self._find(db, job_id)

    def get_job(self, job_id: str) -> MapJobRecord:
        """The job ``job_id``, or the one job whose id starts with it; ``MapJobNotFoundError`` else."""
        with self._transaction() as db:
            record = self._find(db, job_id)
            if record is not None:
                return record
            rows = db.execute(_JOB + " WHERE job_id LIKE ? ORDER BY created_at LIMIT 2",
                              (job_id.replace("%", "").replace("_", "") + "%",)).fetchall()
        if len(rows) == 1 and job_id:
            return _job(rows[0])
        raise MapJobNotFoundError(job_id, " (the prefix fits several jobs)" if rows else "")

    def create_job(self, job_id: str, *, command_key: str, input_ref: str, input_hash: str,
                   spec: dict[str, Any]) -> MapJobRecord:
        now = self._clock()
        with self._transaction(write=True) as db:
            db.execute("INSERT INTO map_jobs (job_id, command_key, input_ref, input_hash, spec, status, created_at,"
                       " updated_at) VALUES (?, ?, ?, ?, ?, 'running', ?, ?)",
                       (job_id, command_key, input_ref, input_hash, _encode(spec), now, now))
            return self._get(db, job_id)

    def claim_job(self, job_id: str) -> MapJobRecord:
        """Make this process the job's runner, and the job running; ``MapJobBusyError`` while another
        live process runs it. One that died (or another host's that the store cannot check and
        that left the job ended) is taken over."""
        with self._transaction(write=True) as db:
            record = self._get(db, job_id)
            owner = record.owner
            if record.status == "running" and owner is not None and owner != self._owner \
                    and owner_is_alive(owner, self._owner) is not False:
                raise MapJobBusyError(job_id, f"process {owner.pid} on {owner.host}")
            db.execute("UPDATE map_jobs SET status = 'running', owner_host = ?, owner_pid = ?, owner_start = ?,"
                       " updated_at = ? WHERE job_id = ?",
                       (self._owner.host, self._owner.pid, self._owner.start, self._clock(), job_id))
            return self._get(db, job_id)

    def update_job(self, job_id: str, *, run_id: str | None = None, new_run: bool = False,
                   rows_total: int | None = None, status: str | None = None,
                   summary: dict[str, Any] | None = None) -> MapJobRecord:
        """Change what is given: the run it feeds (``new_run`` counts one more), the rows the input
        holds, how it ended (``status``, which lets its runner go) and its last summary."""
        sets, values = ["updated_at = ?"], [self._clock()]
        if run_id is not None:
            sets.append("run_id = ?")
            values.append(run_id)
        if new_run:
            sets.append("runs = runs + 1")
        if rows_total is not None:
            sets.append("rows_total = ?")
            values.append(rows_total)
        if status is not None:
            if status not in MAP_JOB_STATUSES:
                raise ValueError(f"a dataset job is {', '.join(MAP_JOB_STATUSES)}, not {status!r}")
            sets.append("status = ?")
            values.append(status)
        if summary is not None:
            sets.append("summary = ?")
            values.append(_encode(summary))
        with self._transaction(write=True) as db:
            self._get(db, job_id)
            db.execute(f"UPDATE map_jobs SET {', '.join(sets)} WHERE job_id = ?", (*values, job_id))
            return self._get(db, job_id)

    def _find(self, db: Connection, job_id: str) -> MapJobRecord | None:
        row = db.execute(_JOB + " WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def _get(self, db: Connection, job_id: str) -> MapJobRecord:
        record = self._find(db, job_id)
        if record is None:
            raise MapJobNotFoundError(job_id)
        return record

    # -- rows -----------------------------------------------------------------------------------
    def record_rows(self, job_id: str, outcomes: Sequence[RowOutcome], *,
                    replace_failed: bool = False) -> list[RowOutcome]:
        """Record each outcome whose row has none yet, in one transaction; return those written.

        A row recorded already keeps its record (so an answer delivered twice, after a crash,
        is recorded and exported once), unless it is recorded ``failed`` and ``replace_failed``
        (a retry of failed rows): then the new outcome replaces it."""
        if not outcomes:
            return []
        now = self._clock()
        if not replace_failed:
            written = self._insert_all(job_id, outcomes, now)
            if written is not None:
                return written
        with self._transaction(write=True) as db:
            existing = self._statuses(db, job_id, [outcome.row_key for outcome in outcomes])
            fresh, replaced, seen = [], [], set()
            for outcome in outcomes:
                if outcome.row_key in seen:
                    continue
                seen.add(outcome.row_key)
                was = existing.get(outcome.row_key)
                if was is None:
                    fresh.append(outcome)
                elif was == "failed" and replace_failed:
                    replaced.append(outcome)
            if fresh:
                db.executemany(_INSERT_ROW, [(job_id, *self._values(outcome), now) for outcome in fresh])
            if replaced:
                db.executemany(
                    "UPDATE map_rows SET ordinal = ?, status = ?, answer = ?, error = ?, calls = calls + ?,"
                    " prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?,"
                    " cost_usd = cost_usd + ?, model = ?, run_id = ?, recorded_at = ?"
                    " WHERE job_id = ? AND row_key = ?",
                    [(*self._values(outcome)[1:], now, job_id, outcome.row_key) for outcome in replaced])
        return fresh + replaced

    def _insert_all(self, job_id: str, outcomes: Sequence[RowOutcome], now: float) -> list[RowOutcome] | None:
        """The common case in one statement: no outcome's row is recorded yet (only a crash delivers
        one twice). None, with nothing written, when one is (or repeats): the caller sorts them out."""
        if len({outcome.row_key for outcome in outcomes}) != len(outcomes):
            return None
        rows = [(job_id, *self._values(outcome), now) for outcome in outcomes]
        try:
            with self._transaction(write=True) as db:
                db.executemany(_INSERT_ROW, rows)
        except WorkflowStoreError:  # a row recorded before (its key's primary key): rolled back whole
            return None
        return list(outcomes)

    @staticmethod
    def _values(outcome: RowOutcome) -> tuple[Any, ...]:
        if outcome.status not in ROW_STATUSES:
            raise ValueError(f"a row is {' or '.join(ROW_STATUSES)}, not {outcome.status!r}")
        answer = None
        if outcome.status == "done":
            answer = outcome.answer_json if outcome.answer_json is not None else _encode(outcome.answer)
        return (outcome.row_key, outcome.ordinal, outcome.status, answer, outcome.error, outcome.calls,
                outcome.prompt_tokens, outcome.completion_tokens, outcome.cost_usd, outcome.model, outcome.run_id)

    @staticmethod
    def _statuses(db: Connection, job_id: str, keys: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for start in range(0, len(keys), KEYS_PER_QUERY):
            chunk = keys[start:start + KEYS_PER_QUERY]
            marks = ", ".join("?" * len(chunk))
            found.update(db.execute(f"SELECT row_key, status FROM map_rows WHERE job_id = ? AND row_key IN ({marks})",
                                    (job_id, *chunk)).fetchall())
        return found

    def recorded_ordinals(self, job_id: str, *, statuses: Sequence[str] = ROW_STATUSES) -> Iterator[int]:
        """The input places of the rows recorded with one of ``statuses``, in order, a page at a time."""
        marks = ", ".join("?" * len(statuses))
        after = -1
        while True:
            with self._transaction() as db:
                page = [ordinal for (ordinal,) in db.execute(
                    f"SELECT ordinal FROM map_rows WHERE job_id = ? AND ordinal > ? AND status IN ({marks})"
                    " ORDER BY ordinal LIMIT ?", (job_id, after, *statuses, PAGE_ROWS)).fetchall()]
            yield from page
            if len(page) < PAGE_ROWS:
                return
            after = page[-1]

    def rows(self, job_id: str, *, statuses: Sequence[str] = ROW_STATUSES) -> Iterator[RowOutcome]:
        """The recorded rows with one of ``statuses``, in input order, a page at a time."""
        marks = ", ".join("?" * len(statuses))
        columns = ", ".join(_ROW_COLUMNS)
        after = -1
        while True:
            with self._transaction() as db:
                page = [_row(row) for row in db.execute(
                    f"SELECT {columns} FROM map_rows WHERE job_id = ? AND ordinal > ? AND status IN ({marks})"
                    " ORDER BY ordinal LIMIT ?", (job_id, after, *statuses, PAGE_ROWS)).fetchall()]
            yield from page
            if len(page) < PAGE_ROWS:
                return
            after = page[-1].ordinal

    def totals(self, job_id: str) -> dict[str, Any]:
        """The job's recorded rows by status, and their calls, tokens and cost."""
        with self._transaction() as db:
            self._get(db, job_id)
            rows = db.execute("SELECT status, COUNT(*), SUM(calls), SUM(prompt_tokens), SUM(completion_tokens),"
                              " SUM(cost_usd) FROM map_rows WHERE job_id = ? GROUP BY status", (job_id,)).fetchall()
        totals: dict[str, Any] = {"done": 0, "failed": 0, "calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                  "cost_usd": 0.0}
        for status, count, calls, prompt, completion, cost in rows:
            totals[status] = count
            totals["calls"] += int(calls or 0)
            totals["prompt_tokens"] += int(prompt or 0)
            totals["completion_tokens"] += int(completion or 0)
            totals["cost_usd"] += float(cost or 0.0)
        return totals
