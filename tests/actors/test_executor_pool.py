"""An executor pool: runs placed on the least loaded member, found by id, and one member killed.

    Session(executors=2): executor m0 + executor m1 (each with a standby), sharing 2 workers and 1 store
        run A -> m0 or m1, run B -> the other; C, D the same again (placement by live runs)

One durable runtime of its own for the module (a fresh namespace), killed whole at the end.
Operations hold on a Gauge latch, so every run stays live (and its placement visible) until
the test releases it; tests wait on events with timeouts, never on sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import ray

from opgraph.actors import RunControl, Session
from opgraph.kernel import OperationGraphBuilder

FLOW_TIMEOUT = 90.0
WAIT = 30.0


def run(coroutine: Any, timeout: float = FLOW_TIMEOUT) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@pytest.fixture(scope="module")
def pooled(gauge):
    """A durable runtime with a pool of two executors, in a throwaway namespace."""
    namespace = f"opgraph-pool-{uuid.uuid4().hex[:8]}"
    session = Session(namespace=namespace, executors=2)
    session.register_operation("held", _held(gauge), record_turn=False)
    yield session
    session.runtime.kill()


def _held(gauge: Any):
    """Counts its entry per label, then holds until its key is released."""

    async def held(branch: Any, key: str, label: str, **parameters: Any) -> dict[str, Any]:
        await gauge.enter.remote(key)
        await gauge.enter.remote(f"{key}/{label}")
        await gauge.wait_released.remote(key)
        return {"label": label, "idempotency_key": list(branch.idempotency_key)}

    return held


def _graph(key: str, labels: list[str]):
    builder = OperationGraphBuilder("pooled")
    ids = {label: builder.add_operation("held", depends_on=[], key=key, label=label) for label in labels}
    return builder.get_graph(), ids


def _loads(session: Session) -> list[tuple[int, int]]:
    return [tuple(ray.get(executor.load.remote())) for executor in session.runtime.executors]


def test_runs_spread_over_the_members_and_each_is_found_by_id_on_its_own(pooled, gauge):
    """Four runs of 3 held nodes, admitted together: two live on each member. Each is found by
    id through RunControl.attach (as from any client) and Session.run_control, on the member that
    owns it, whose status() answers for it; released, all four complete, and member 1 keeps
    no branch of them once they are released."""
    keys = [f"spread-{index}" for index in range(4)]
    refs: list[dict[str, Any]] = [{} for _ in keys]

    async def scenario():
        flows = [asyncio.create_task(pooled.flow(_graph(key, ["a", "b", "c"])[0], executor_ref=ref,
                                                 isolated=True))
                 for key, ref in zip(keys, refs, strict=True)]
        for key in keys:
            await asyncio.wait_for(gauge.wait_entered.remote(key, 3), WAIT)
        loads = _loads(pooled)
        owners = {}
        for ref in refs:
            control = ref["executor"]
            attached = await asyncio.to_thread(RunControl.attach, ref["run_id"], address=None,
                                               namespace=pooled.runtime.namespace)
            local = await asyncio.to_thread(pooled.run_control, ref["run_id"])
            status = await attached.status()
            owners[ref["run_id"]] = (control.executor_name, attached.executor_name, local.executor_name,
                                     status["executor"], status["running"])
        for key in keys:
            await gauge.release.remote(key)
        envelopes = await asyncio.gather(*flows)
        return loads, owners, envelopes

    loads, owners, envelopes = run(scenario())

    assert [runs for runs, _ in loads] == [2, 2]
    assert [nodes for _, nodes in loads] == [6, 6]
    names = set(pooled.runtime.executor_names)
    for run_id, (started_on, attached_on, local_on, status_on, running) in owners.items():
        assert started_on in names and started_on == attached_on == local_on == status_on, (run_id, owners)
        assert running == 3
    assert sorted(sum(started_on == name for started_on, *_ in owners.values()) for name in names) == [2, 2]
    assert [envelope["status"] for envelope in envelopes] == ["completed"] * 4
    for envelope in envelopes:
        run(pooled.release_run(envelope["run_id"]))
    # Member 1 borrowed the Session's default branch for its runs and made theirs: nothing stays.
    held = ray.get(pooled.runtime.executors[1].statistics.remote())["branches"]
    assert held["branches"] == 0 and held["scopes"] == 0, held


def test_a_killed_member_recovers_its_durable_run_and_the_other_members_run_is_untouched(pooled, gauge):
    """Run A (4 held nodes) on one member, run B (4 settled + 4 held) on the other; B's member
    is killed. A completes with every node run once (attempt 1) on a member never replaced;
    B's member is replaced (its standby promoted), which rebuilds B from the run log: B's
    settled nodes are not run again, its in-flight ones run again as attempt 2."""
    key_a, key_b = "untouched", "recovered"
    graph_a, ids_a = _graph(key_a, [f"a{index}" for index in range(4)])
    builder = OperationGraphBuilder("recovered")
    quick = [builder.add_operation("held", depends_on=[], key=f"{key_b}-quick", label=f"done{index}")
             for index in range(4)]
    held_b = [builder.add_operation("held", depends_on=[], key=key_b, label=f"b{index}") for index in range(4)]
    ray.get(gauge.release.remote(f"{key_b}-quick"))
    ref_a: dict[str, Any] = {}
    ref_b: dict[str, Any] = {}
    runtime = pooled.runtime
    before = list(runtime.executors)

    async def scenario():
        settled = asyncio.Event()
        completed: list[str] = []

        def progress(op_id: str, name: str, status: str, elapsed: float) -> None:
            if status == "completed":
                completed.append(op_id)
                if len(completed) == len(quick):
                    settled.set()

        flow_a = asyncio.create_task(pooled.flow(graph_a, executor_ref=ref_a, max_concurrent=8))
        await asyncio.wait_for(gauge.wait_entered.remote(key_a, 4), WAIT)
        flow_b = asyncio.create_task(pooled.flow(builder.get_graph(), executor_ref=ref_b, max_concurrent=8,
                                                 on_progress=progress))
        await asyncio.wait_for(gauge.wait_entered.remote(key_b, 4), WAIT)
        await asyncio.wait_for(settled.wait(), WAIT)  # B's quick nodes settled (and logged) before the kill
        victim = ref_b["executor"].executor
        assert victim is not ref_a["executor"].executor, "A and B were placed on the same member"
        ray.kill(victim, no_restart=True)
        await asyncio.wait_for(gauge.wait_entered.remote(key_b, 8), WAIT)  # B's 4 lost attempts ran again
        await gauge.release.remote(key_b)
        envelope_b = await flow_b
        await gauge.release.remote(key_a)
        return await flow_a, envelope_b, victim

    envelope_a, envelope_b, victim = run(scenario())

    member_a, member_b = runtime.member_of(ref_a["executor"].executor), runtime.member_of(victim)
    assert envelope_a["status"] == "completed" and envelope_b["status"] == "completed"
    attempts_a = [envelope_a["operation_results"][node]["idempotency_key"][2] for node in ids_a.values()]
    assert attempts_a == [1, 1, 1, 1]
    entered_a = [ray.get(gauge.snapshot.remote(f"{key_a}/a{index}"))["entered"] for index in range(4)]
    assert entered_a == [1, 1, 1, 1]
    assert runtime.executors[member_a] is before[member_a]
    survivor = ray.get(runtime.executors[member_a].statistics.remote())
    assert survivor["recovered_runs"] == [] and survivor["name"] == runtime.executor_names[member_a]
    entered_quick = [ray.get(gauge.snapshot.remote(f"{key_b}-quick/done{index}"))["entered"] for index in range(4)]
    assert entered_quick == [1, 1, 1, 1]
    attempts_b = sorted(envelope_b["operation_results"][node]["idempotency_key"][2] for node in held_b)
    assert attempts_b == [2, 2, 2, 2]
    assert set(envelope_b["completed_operations"]) == set(quick) | set(held_b)
    replacement = ray.get(runtime.executors[member_b].statistics.remote())
    assert replacement["recovered_runs"] == [envelope_b["run_id"]] and replacement["member"] == member_b
    assert replacement["name"] == runtime.names.executor_of(1, member_b) and "promoted" in replacement["timeline"]
