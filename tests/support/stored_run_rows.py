"""Runs written into a database the way opgraph writes them, for the retention tests.

``RunRows`` writes through the real write paths: the run store's (a lane run's record,
signals, node results and branch messages; an engine run and its events), the runtime's
run log (``RunLog.begin``/``append``/``finish``) and its branch journal (records, heads and
messages, as a durable BranchStore flushes them). Headers and record batches are opaque
bytes: retention never decodes them. ``clock`` stamps the store's rows (``now`` moves it).
Also runnable as a script: ``python stored_run_rows.py TARGET COUNT`` writes COUNT lane
runs with their run logs (a concurrent writer for the tests), saying ``started`` first.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from opgraph.actors.persistence.branchlog import BranchJournal
from opgraph.actors.persistence.database import Database
from opgraph.actors.persistence.runlog import RunLog
from opgraph.cluster.store import OWNER_PROCESS_LOST, EngineRunStore, RunStore

__all__ = ["TABLES", "RunRows", "table_counts"]

TABLES = ("runs", "run_signals", "run_nodes", "run_branches", "engine_runs", "engine_events", "runtime_runs",
          "runtime_run_headers", "runtime_run_records", "runtime_branch_heads", "runtime_branch_records",
          "runtime_branch_messages")
FIXED_CAPABILITIES = {"cancel": True, "checkpoint_resume": True, "leased_admission": False, "live_message": False,
                      "live_pause": False, "planner": False, "reactive_growth": False}
PLANNED_CAPABILITIES = {**FIXED_CAPABILITIES, "live_message": True, "live_pause": True, "planner": True,
                        "reactive_growth": True}


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RunRows:
    """A store and the runtime's tables on one database (a SQLite path or a PostgreSQL URL)."""

    def __init__(self, target: Any, *, clock: Clock | None = None) -> None:
        self.target = str(target)
        self.clock = clock or Clock()
        self.store = RunStore(self.target, clock=self.clock)
        self.engines = EngineRunStore(self.target, clock=self.clock)
        self.database = Database(self.target)
        self.log = RunLog(database=self.database)
        self.journals: dict[tuple[str, int], BranchJournal] = {}

    def close(self) -> None:
        self.store.close()
        self.engines.close()
        self.database.close()

    def __enter__(self) -> RunRows:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- runs -----------------------------------------------------------------------------
    def lane_run(self, run_id: str | None = None, *, status: str = "completed", lane: str = "fixed_workflow",
                 durable: bool = True, log_status: str | None = None, error: Any = None, nodes: int = 3,
                 branches: Sequence[str] = (), capabilities: dict[str, bool] | None = None,
                 resumed_from: str | None = None, at: float | None = None, ended: float | None = None) -> str:
        """A lane run as the lanes record it: admitted, running, signals and node results per node, its
        branches' messages, then its end (``status``, at ``ended`` when given); with its run log when
        ``durable``. ``at`` is when it was made."""
        run_id = run_id or str(uuid.uuid4())
        if at is not None:
            self.clock.now = at
        source = {"kind": "workflow_file", "ref": "flow.json", "version": None,
                  "content_hash": "sha256:" + "0" * 64}
        if resumed_from is not None:
            source["resumed_from"] = resumed_from
        if capabilities is None:
            capabilities = PLANNED_CAPABILITIES if lane != "fixed_workflow" else FIXED_CAPABILITIES
        self.store.create_run(run_id, session_id="session-test", provenance={"lane": lane, "source": source},
                              inputs={"ticket": "x"}, capabilities=capabilities, recovery={"labels": {}})
        self.store.mark_running(run_id)
        if durable:
            self.log.begin(run_id, "executor-test", b"header " * 200, self.clock.now)
        for index in range(nodes):
            node = f"n{index}"
            self.store.record_progress(run_id, signals=[{"node_id": node, "kind": "started"},
                                                        {"node_id": node, "kind": "completed", "elapsed": 0.1}],
                                       nodes=[{"node_id": node, "status": "completed", "result": {"text": "ok"}}])
            if durable:
                self.log.append([(run_id, index + 1, b"batch " * 50)])
        for branch_id in branches:
            self.store.record_branch(run_id, branch_id, node_id="n0", messages=[{"role": "user", "content": "hi"}])
        if status not in ("admitted", "running"):
            if ended is not None:
                self.clock.now = ended
            if status == "failed" and error is None:
                error = {"run": {"error": "a node failed"}}
            self.store.finish_run(run_id, status, outputs={"n0": "ok"}, error=error)
            if durable:
                self.log.finish(run_id, log_status or status, None, None)
        return run_id

    def orphaned_run(self, run_id: str | None = None, *, durable: bool = True, **options: Any) -> str:
        """A lane run whose owner process died mid-run: failed, OwnerProcessLost; its log still live."""
        return self.lane_run(run_id, status="failed", durable=durable, log_status="live",
                             error={"error": "the process exited", "error_type": OWNER_PROCESS_LOST}, **options)

    def logged_run(self, run_id: str | None = None, *, status: str = "completed", started: float | None = None,
                   batches: int = 2) -> str:
        """A run only the run log knows (a Python ``Session.flow``): ``status`` live leaves it unended."""
        run_id = run_id or str(uuid.uuid4())
        self.log.begin(run_id, "executor-test", b"header " * 200, self.clock.now if started is None else started)
        self.log.append([(run_id, seq, b"batch " * 50) for seq in range(1, batches + 1)])
        if status != "live":
            self.log.finish(run_id, status, None, "boom" if status == "error" else None)
        return run_id

    def engine_run(self, run_id: str | None = None, *, status: str = "completed", events: int = 3,
                   at: float | None = None) -> str:
        from opgraph.engines.events import EventRecord

        run_id = run_id or str(uuid.uuid4())
        if at is not None:
            self.clock.now = at
        self.engines.open_run(run_id, engine="review", inputs={"x": 1}, config={})
        self.engines.record_events(run_id, [EventRecord(run_id, seq, "event", "note", {"n": seq}, "agent",
                                                        self.clock.now)
                                            for seq in range(1, events + 1)])
        if status != "running":
            self.engines.close_run(run_id, status, result="done", degrade_reason="", error=None, statistics={})
        return run_id

    # -- branches -------------------------------------------------------------------------
    def branch(self, branch_id: str, messages: int = 2, *, parent: int | None = None, parent_len: int = 0,
               owner: str = "owner-a", shard: int = 0) -> int:
        """A branch head on a new record (a clone of record ``parent`` when given); the record's id."""
        journal = self.journals.setdefault((owner, shard), BranchJournal(shard, owner=owner))
        record = journal.new_record(parent, parent_len, [{"role": "assistant", "content": f"m{index}"}
                                                         for index in range(messages)])
        journal.head(branch_id, record)
        journal.write(self.database, journal.take())
        return record


def table_counts(target: Any) -> dict[str, int]:
    """Rows per table of ``TABLES``."""
    with RunStore(str(target)) as store, store.transaction() as db:
        return {table: int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]) for table in TABLES}


def _write_runs(target: str, count: int) -> None:
    with RunRows(target, clock=Clock(time.time())) as rows:
        print("started", flush=True)
        for index in range(count):
            rows.clock.now = time.time()
            run_id = rows.lane_run(branches=[f"run-writer-{index}-default"])
            rows.store.get_run(run_id)  # a read between writes, as a server's GET is
            print(f"wrote {index + 1}", flush=True)


if __name__ == "__main__":
    _write_runs(sys.argv[1], int(sys.argv[2]))
