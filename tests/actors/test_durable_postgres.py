"""A durable runtime whose run log and branches live in PostgreSQL: its executor and store are killed.

The runtime (a Session in a namespace of its own: executor, two workers, a branch store)
is started with ``OPGRAPH_DB`` set to a new database on the session's real PostgreSQL
server, so every actor writes there. Topology of the run:

    done0..done3 (settle at once)      n0..n3 (held in flight when the executor dies)

The replacement executor rebuilds the run from the PostgreSQL log; then the branch
store dies and its replacement reloads the branches from PostgreSQL.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
import ray

from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder

WAIT = 30.0


@pytest.fixture()
def postgres_runtime(postgres_server, monkeypatch):
    url = postgres_server.database()
    monkeypatch.setenv("OPGRAPH_DB", url)  # read when the runtime starts: its actors get the URL
    session = Session(namespace=f"opgraph-pg-{uuid.uuid4().hex[:8]}")
    yield session, url
    session.runtime.kill()


def held(gauge: Any):
    async def operation(branch: Any, key: str, label: str, **parameters: Any) -> dict[str, Any]:
        await branch.append({"role": "user", "content": f"turn of {label}"})
        await gauge.enter.remote(key)
        await gauge.wait_released.remote(key)
        return {"label": label, "attempt": branch.idempotency_key[2]}

    return operation


def test_a_run_logged_in_postgres_outlives_its_executor_and_branches_outlive_their_store(postgres_runtime, gauge):
    session, url = postgres_runtime
    session.register_operation("held", held(gauge), record_turn=False)
    builder = OperationGraphBuilder("pg-durable")
    quick = [builder.add_operation("held", depends_on=[], key="pg-quick", label=f"done{i}") for i in range(4)]
    slow = [builder.add_operation("held", depends_on=[], key="pg-slow", label=f"n{i}") for i in range(4)]
    ray.get(gauge.release.remote("pg-quick"))
    executor = session.runtime.executor
    branch = session.new_branch("kept", [{"role": "system", "content": "kept in postgres"}])

    async def scenario():
        flow = asyncio.create_task(session.flow(builder.get_graph(), max_concurrent=8))
        await asyncio.wait_for(gauge.wait_entered.remote("pg-quick", 4), WAIT)
        await asyncio.wait_for(gauge.wait_entered.remote("pg-slow", 4), WAIT)
        ray.kill(executor, no_restart=True)
        await asyncio.wait_for(gauge.wait_entered.remote("pg-slow", 8), WAIT)  # the lost attempts ran again
        await gauge.release.remote("pg-slow")
        return await asyncio.wait_for(flow, 60)

    envelope = asyncio.run(scenario())
    assert envelope["status"] == "completed"
    assert set(envelope["completed_operations"]) == set(quick) | set(slow)
    assert sorted(envelope["operation_results"][node]["attempt"] for node in slow) == [2, 2, 2, 2]
    assert session.runtime.executor._actor_id != executor._actor_id
    with psycopg.connect(url) as connection:
        status = connection.execute("SELECT status FROM runtime_runs WHERE run_id = %s",
                                    (envelope["run_id"],)).fetchone()
        assert status == ("completed",)
        assert connection.execute("SELECT count(*) FROM runtime_branch_heads").fetchone()[0] >= 1

    ray.kill(session.runtime.stores[0], no_restart=True)
    messages = asyncio.run(asyncio.wait_for(session.messages(branch), WAIT))
    assert messages == [{"role": "system", "content": "kept in postgres"}]
