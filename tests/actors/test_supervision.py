"""Supervision: real actors killed on purpose (ray.kill and SIGKILL of the pid), runs go on.

Every test has a runtime of its own (a Session in a fresh namespace: its own executor,
two workers and a branch store), so it kills nothing another test relies on, and stands
alone. Operations hold on a Gauge latch, so a kill lands while exactly the calls the test
means are in flight; tests wait on events with timeouts, never on sleeps.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
import uuid
from typing import Any

import pytest
import ray

from opgraph.actors import RunControl, RuntimeLostError, Session
from opgraph.actors.persistence import RunLog, database_path
from opgraph.kernel import Graph, OperationGraphBuilder, SpawnRequest, create_operation

FLOW_TIMEOUT = 90.0
WAIT = 30.0


def run(coroutine: Any, timeout: float = FLOW_TIMEOUT) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


@pytest.fixture()
def own():
    """A durable runtime of its own (the default), in a throwaway namespace; killed whole afterwards."""
    session = Session(namespace=f"opgraph-supervision-{uuid.uuid4().hex[:8]}")
    yield session
    session.runtime.kill()


@pytest.fixture()
def volatile():
    """A runtime of its own that keeps nothing on disk (``durable=False``)."""
    session = Session(namespace=f"opgraph-volatile-{uuid.uuid4().hex[:8]}", durable=False)
    yield session
    session.runtime.kill()


def statistics(session: Session) -> dict[str, Any]:
    return ray.get(session.runtime.executor.statistics.remote())


def wait_for_pool(session: Session, kind: str, check, seconds: float = WAIT) -> dict[str, Any]:
    """Poll the executor's ``kind`` pool statistics until ``check`` holds (or fail after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        snapshot = statistics(session)[kind]
        if check(snapshot):
            return snapshot
        if time.monotonic() > deadline:
            raise AssertionError(f"{kind} never reached the expected state: {snapshot}")
        time.sleep(0.05)


def pool(session: Session) -> dict[str, Any]:
    return ray.get(session.runtime.executor.pool.remote())


def kill(handle: Any, how: str) -> None:
    """``ray.kill`` the actor, or SIGKILL its process."""
    if how == "ray.kill":
        ray.kill(handle, no_restart=True)
    else:
        os.kill(ray.get(handle.statistics.remote())["pid"], signal.SIGKILL)


def held_operation(gauge: Any):
    """Tells the Gauge it entered (per node, and which worker runs it), then holds until released."""

    async def held(branch: Any, key: str, label: str, **parameters: Any) -> dict[str, Any]:
        worker = ray.get_runtime_context().get_actor_id()
        await gauge.enter.remote(key, label, worker)
        await gauge.enter.remote(f"{key}/{label}")
        try:
            await gauge.wait_released.remote(key)
        finally:
            await gauge.exit.remote(key)
        return {"label": label, "idempotency_key": list(branch.idempotency_key)}

    return held


def labelled(operation: str, key: str, labels: list[str]) -> tuple[Graph, dict[str, str]]:
    builder = OperationGraphBuilder("labelled")
    ids = {label: builder.add_operation(operation, depends_on=[], key=key, label=label) for label in labels}
    return builder.get_graph(), ids


async def start_held(session: Session, gauge: Any, graph: Graph, key: str, in_flight: int,
                     **options: Any) -> asyncio.Task:
    """Start the flow of ``graph`` (held nodes under ``key``), ``in_flight`` at most at once; return
    its task once that many are in flight."""
    flow = asyncio.create_task(session.flow(graph, max_concurrent=in_flight, **options))
    await asyncio.wait_for(gauge.wait_entered.remote(key, in_flight), WAIT)
    return flow


class Progress:
    """on_progress that keeps every (node, status) and wakes waiters on each."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        self.seen.append((op_id, status))
        self.changed.set()

    def count(self, status: str) -> int:
        return sum(1 for _, seen in self.seen if seen == status)

    async def wait_count(self, status: str, count: int) -> None:
        while self.count(status) < count:
            self.changed.clear()
            await self.changed.wait()


async def entries(gauge: Any, key: str, labels: list[str]) -> dict[str, int]:
    return {label: (await gauge.snapshot.remote(f"{key}/{label}"))["entered"] for label in labels}


# -- a worker dies mid-run ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_worker_killed_mid_run_fails_only_what_was_in_flight_on_it(own, gauge, how):
    """n0..n7 held in flight over two workers, n8..n15 queued (max_concurrent=8); one worker is killed.

    Only the nodes in flight on it fail (WorkerDied, naming the worker and run); every
    queued node runs later on live workers, none of them twice, and the next run of the
    same Session completes on a live replacement.
    """
    key = f"mid-run-{how}"
    own.register_operation("held", held_operation(gauge), record_turn=False)
    labels = [f"n{i}" for i in range(16)]
    graph, ids = labelled("held", key, labels)
    progress = Progress()

    async def scenario():
        flow = await start_held(own, gauge, graph, key, 8, on_progress=progress)
        placement = await gauge.worker_of.remote(key)
        victim_id = placement["n0"]
        [victim] = [w for w in own.runtime.workers if w._actor_id.hex() == victim_id]
        on_victim = sorted(label for label, worker in placement.items() if worker == victim_id)
        kill(victim, how)
        await asyncio.wait_for(progress.wait_count("failed", len(on_victim)), WAIT)
        await gauge.release.remote(key)
        envelope = await flow
        return envelope, on_victim, await entries(gauge, key, labels)

    envelope, on_victim, entered = run(scenario())

    failed = {ids[label] for label in on_victim}
    statuses = envelope["operation_statuses"]
    assert {node for node, status in statuses.items() if status == "failed"} == failed
    assert {node for node, status in statuses.items() if status == "completed"} == set(ids.values()) - failed
    for node in failed:
        result = envelope["operation_results"][node]
        assert result["error_type"] == "WorkerDied"
        assert "opgraph-worker-" in result["error"] and envelope["run_id"] in result["error"]
    # Nothing ran twice. A node on the victim may have died between the Gauge's two entries
    # (the one the test waits on, and the per-node one counted here): 0 or 1 for those.
    assert all(entered[label] == 1 for label in labels if label not in on_victim), entered
    assert all(entered[label] <= 1 for label in on_victim), entered

    ray.get(gauge.release.remote(f"{key}-after"))  # the next run's nodes need not hold
    after = run(own.flow(labelled("held", f"{key}-after", ["a", "b", "c", "d"])[0], max_concurrent=4),
                timeout=WAIT)
    assert after["status"] == "completed"
    wait_for_pool(own, "worker_pool", lambda workers: workers["replacements"] >= 1 and workers["alive"] == 2)


def test_a_worker_death_is_retried_as_a_new_attempt_under_the_retry_policy(own, gauge):
    """n0..n3 held over two workers with retry=2; one worker is killed: its nodes run again as
    attempt 2 (a new idempotency key) on a live worker, and the run completes."""
    key = "retried"
    own.register_operation("held", held_operation(gauge), record_turn=False, retry=2)
    labels = ["n0", "n1", "n2", "n3"]
    graph, ids = labelled("held", key, labels)

    async def scenario():
        flow = await start_held(own, gauge, graph, key, 4)
        placement = await gauge.worker_of.remote(key)
        victim_id = placement["n0"]
        [victim] = [w for w in own.runtime.workers if w._actor_id.hex() == victim_id]
        on_victim = [label for label, worker in placement.items() if worker == victim_id]
        kill(victim, "SIGKILL")
        await asyncio.wait_for(gauge.wait_entered.remote(key, 4 + len(on_victim)), WAIT)
        await gauge.release.remote(key)
        return await flow, on_victim

    envelope, on_victim = run(scenario())

    assert envelope["status"] == "completed"
    results = envelope["operation_results"]
    for label in on_victim:
        assert results[ids[label]]["idempotency_key"] == [envelope["run_id"], ids[label], 2]
    for label in set(labels) - set(on_victim):
        assert results[ids[label]]["idempotency_key"][2] == 1


def test_when_every_worker_dies_finished_nodes_stay_completed_and_the_session_recovers(own, gauge):
    """done (finished first) | n0, n1 held on both workers; both workers die: done stays completed,
    only n0 and n1 fail, and the next run completes on replacements."""
    own.register_operation("held", held_operation(gauge), record_turn=False)
    builder = OperationGraphBuilder("all-die")
    done = builder.add_operation("noop", depends_on=[], instruction="quick")
    held = [builder.add_operation("held", depends_on=[], key="all", label=label) for label in ("n0", "n1")]
    progress = Progress()

    async def scenario():
        flow = asyncio.create_task(own.flow(builder.get_graph(), max_concurrent=3, on_progress=progress))
        await asyncio.wait_for(gauge.wait_entered.remote("all", 2), WAIT)
        await asyncio.wait_for(progress.wait_count("completed", 1), WAIT)
        for worker in list(own.runtime.workers):
            kill(worker, "ray.kill")
        return await flow

    envelope = run(scenario())

    assert envelope["operation_statuses"][done] == "completed"
    assert {envelope["operation_statuses"][node] for node in held} == {"failed"}
    assert {envelope["operation_results"][node]["error_type"] for node in held} == {"WorkerDied"}
    ray.get(gauge.release.remote("all-after"))
    after = run(own.flow(labelled("held", "all-after", ["a", "b"])[0], max_concurrent=2), timeout=WAIT)
    assert after["status"] == "completed"


# -- a worker dies while idle ----------------------------------------------------------------
def test_an_idle_worker_death_is_noticed_by_the_probe_and_replaced_within_five_seconds(own):
    """Kill a worker while nothing runs: the executor's probe notices it and starts a replacement."""
    victim = own.runtime.workers[0]
    before = statistics(own)["worker_pool"]
    kill(victim, "SIGKILL")
    wait_for_pool(own, "worker_pool", lambda workers: workers["replacements"] > before["replacements"]
                  and workers["alive"] == workers["size"], seconds=5.0)
    assert pool(own)["workers"][0]._actor_id != victim._actor_id
    graph = Graph("after-idle-death")
    for index in range(20):
        graph.add_node(create_operation("noop", {"instruction": f"n{index}"}))
    assert run(own.flow(graph, max_concurrent=20), timeout=WAIT)["status"] == "completed"


def test_work_sent_to_a_dead_worker_before_anyone_noticed_runs_again_and_does_not_fail(own):
    """Both workers SIGKILLed, and a 200-node fan-out started at once: batches that reach a dead
    worker never started, so they are re-dispatched, not failed; every node completes once."""
    for worker in list(own.runtime.workers):
        kill(worker, "SIGKILL")
    graph = Graph("undelivered")
    for index in range(200):
        graph.add_node(create_operation("noop", {"instruction": f"n{index}"}))

    envelope = run(own.flow(graph, max_concurrent=200), timeout=WAIT)

    assert envelope["status"] == "completed"
    assert envelope["failed_operations"] == []
    wait_for_pool(own, "worker_pool", lambda workers: workers["deaths"] == 2 and workers["alive"] == 2)


# -- a branch store dies ----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_dead_volatile_branch_store_is_replaced_empty_and_the_loss_is_reported(volatile, gauge, how):
    """reads_branch x3 (on a seeded branch) wait while a store that keeps nothing is killed, then
    read: the calls wait for the replacement and go on, on a branch that came back empty; the run
    completes and reports the branch lost. The Session's next run records turns normally."""

    async def reads_branch(branch, key: str, **parameters):
        await gauge.enter.remote(key)
        await gauge.wait_released.remote(key)
        return await branch.messages()

    key = f"store-{how}"
    volatile.register_operation("reads_branch", reads_branch, record_turn=False)
    seeded = volatile.new_branch("seeded", messages=[{"role": "system", "content": "seed"}])
    builder = OperationGraphBuilder("store-death")
    first = [builder.add_operation("reads_branch", depends_on=[], key=key) for _ in range(3)]

    async def scenario():
        flow = asyncio.create_task(volatile.flow(builder.get_graph(), max_concurrent=3, default_branch=seeded))
        await asyncio.wait_for(gauge.wait_entered.remote(key, 3), WAIT)
        kill(volatile.runtime.stores[0], how)
        await gauge.release.remote(key)
        return await flow

    envelope = run(scenario())

    assert {envelope["operation_statuses"][node] for node in first} == {"completed"}
    assert {repr(envelope["operation_results"][node]) for node in first} == {"[]"}  # the seed is gone
    assert seeded in [entry["branch_id"] for entry in envelope["lost_branches"]]

    chain = OperationGraphBuilder("after-store-death")
    head = chain.add_operation("chat", instruction="first")
    chain.add_operation("chat", depends_on=[head], instruction="second")
    after = run(volatile.flow(chain.get_graph()), timeout=WAIT)
    assert after["status"] == "completed", after["operation_results"]
    messages = run(volatile.messages(volatile.default_branch), timeout=WAIT)
    assert [message["content"] for message in messages if message["role"] == "user"] == ["first"]


# -- the executor dies ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_dead_volatile_executor_is_a_typed_error_within_seconds_and_the_next_flow_completes(volatile, gauge,
                                                                                            how):
    """n0..n3 held; the executor is killed mid-run: flow() raises RuntimeLostError naming the
    executor and the run within seconds; the same Session's next flow runs on a new executor."""
    key = f"executor-{how}"
    volatile.register_operation("held", held_operation(gauge), record_turn=False)
    graph, _ = labelled("held", key, ["n0", "n1", "n2", "n3"])
    executor = volatile.runtime.executor
    run_id = f"doomed-{how}"

    async def scenario():
        flow = await start_held(volatile, gauge, graph, key, 4, run_id=run_id)
        killed_at = time.monotonic()
        kill(executor, how)
        with pytest.raises(RuntimeLostError) as lost:
            await flow
        return lost.value, time.monotonic() - killed_at

    error, seconds = run(scenario())

    assert seconds < 10.0
    assert error.run_id == run_id and error.actor.startswith("opgraph-executor-")
    ray.get(gauge.release.remote(key))
    volatile.register_operation("held_again", held_operation(gauge), record_turn=False)
    ray.get(gauge.release.remote(f"{key}-after"))
    after = run(volatile.flow(labelled("held_again", f"{key}-after", ["a", "b"])[0]), timeout=WAIT)
    assert after["status"] == "completed"
    assert volatile.runtime.executor._actor_id != executor._actor_id


LOST_WITHIN = 5.0  # seconds: losing a run that is not durable is reported at once, not after a search


def test_a_run_that_is_not_durable_is_reported_lost_within_seconds_to_every_control(own, gauge):
    """n0..n3 held, run with durable=False on a durable runtime; its executor is SIGKILLed.

    flow(), and status() and watch() on each way of holding the run (the executor_ref handle,
    Session.run_control, RunControl.attach) raise RuntimeLostError within seconds: nothing will
    ever rebuild a run that was not logged, so no control looks for it (issue #32: 60 s each).
    """
    key = "volatile-run-controls"
    own.register_operation("held", held_operation(gauge), record_turn=False)
    graph, _ = labelled("held", key, ["n0", "n1", "n2", "n3"])
    run_id = f"not-logged-{uuid.uuid4().hex[:8]}"
    executor_ref: dict[str, Any] = {}

    async def lost(call: Any) -> float:
        started = time.monotonic()
        with pytest.raises(RuntimeLostError) as raised:
            await call()
        assert raised.value.run_id == run_id
        return time.monotonic() - started

    async def watch_to_the_end(control: Any) -> None:
        async for _ in control.watch():
            pass

    async def scenario() -> dict[str, float]:
        flow = await start_held(own, gauge, graph, key, 4, run_id=run_id, durable=False, executor_ref=executor_ref)
        controls = {"executor_ref": executor_ref["executor"], "run_control": own.run_control(run_id),
                    "attach": await asyncio.to_thread(RunControl.attach, run_id, address=None,
                                                      namespace=own.runtime.namespace)}
        assert {name: control.durable for name, control in controls.items()} == dict.fromkeys(controls, False)
        kill(own.runtime.executor, "SIGKILL")
        seconds = {"flow": await lost(lambda: flow)}
        for name, control in controls.items():
            seconds[f"{name}.status"] = await lost(control.status)
            seconds[f"{name}.watch"] = await lost(lambda control=control: watch_to_the_end(control))
        return seconds

    seconds = run(scenario())
    ray.get(gauge.release.remote(key))
    assert max(seconds.values()) < LOST_WITHIN, seconds


def test_a_detached_runtime_sets_a_replacement_up_before_it_runs_anything(gauge):
    """A detached runtime (shared by name): a worker dies mid-run, and the run's queued nodes that
    land on the replacement run with the run's operations (none 'not registered')."""
    namespace = f"opgraph-supervision-detached-{uuid.uuid4().hex[:8]}"
    detached = Session(namespace=namespace, detached=True)
    try:
        key = "detached"
        detached.register_operation("held", held_operation(gauge), record_turn=False)
        graph, _ = labelled("held", key, [f"n{i}" for i in range(8)])
        progress = Progress()

        async def scenario():
            flow = await start_held(detached, gauge, graph, key, 4, on_progress=progress)
            kill(detached.runtime.workers[0], "SIGKILL")
            await asyncio.to_thread(wait_for_pool, detached, "worker_pool",
                                    lambda workers: workers["replacements"] >= 1 and workers["alive"] == 2)
            await gauge.release.remote(key)
            return await flow

        envelope = run(scenario())
        kinds = {envelope["operation_results"][node].get("error_type") for node in envelope["failed_operations"]}
        assert kinds <= {"WorkerDied"}
        completed = [node for node, status in envelope["operation_statuses"].items() if status == "completed"]
        assert len(completed) >= 4  # at least the queued half ran, part of it on the replacement
        assert pool(detached)["worker_names"][0].endswith(".g1")
    finally:
        detached.close()
        detached.runtime.kill()


# -- durable runtimes: the run outlives its executor, branches outlive their store ------------------
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_durable_run_outlives_its_executor_and_flow_returns_the_whole_envelope(own, gauge, how):
    """done0..done3 settle, n0..n3 are held in flight, n4..n7 queued (max_concurrent=4); the executor
    is killed. Its replacement rebuilds the run from the log: flow() keeps waiting and returns every
    node completed; the settled ones ran once, the in-flight ones once more as attempt 2."""
    key = f"durable-{how}"
    own.register_operation("held", held_operation(gauge), record_turn=False)
    builder = OperationGraphBuilder("durable")
    quick = [builder.add_operation("held", depends_on=[], key=f"{key}-quick", label=f"done{i}") for i in range(4)]
    held = {f"n{i}": builder.add_operation("held", depends_on=[], key=key, label=f"n{i}") for i in range(8)}
    ray.get(gauge.release.remote(f"{key}-quick"))
    executor = own.runtime.executor
    progress = Progress()

    async def scenario():
        flow = asyncio.create_task(own.flow(builder.get_graph(), max_concurrent=4, on_progress=progress))
        await asyncio.wait_for(progress.wait_count("completed", 4), WAIT)
        await asyncio.wait_for(gauge.wait_entered.remote(key, 4), WAIT)
        kill(executor, how)
        await asyncio.wait_for(gauge.wait_entered.remote(key, 8), WAIT)  # the 4 lost attempts ran again
        await gauge.release.remote(key)
        return await flow

    envelope = run(scenario())

    assert envelope["status"] == "completed"
    assert set(envelope["completed_operations"]) == set(quick) | set(held.values())
    entered = run(entries(gauge, f"{key}-quick", [f"done{i}" for i in range(4)]))
    assert set(entered.values()) == {1}  # settled before the kill: never run again
    attempts = {node: envelope["operation_results"][node]["idempotency_key"][2] for node in held.values()}
    assert sorted(attempts.values()) == [1, 1, 1, 1, 2, 2, 2, 2]
    assert own.runtime.executor._actor_id != executor._actor_id
    replacement = statistics(own)
    assert replacement["recovered_runs"] == [envelope["run_id"]]
    # The spare that stood by took over (no process started after the kill), and a new one stands by.
    timeline = replacement["timeline"]
    assert "promoted" in timeline and timeline["created"] < timeline["promoted"]
    assert replacement["name"].endswith(".g1") and not replacement["standby"]
    assert ray.get(own.runtime.standby.is_standby.remote()) is True


async def emit_invalid(branch: Any, count: int = 0, **parameters: Any) -> str:
    """Emit ``count`` spawn requests that fail validation: half sent live while the emitter still
    runs, half only just before it returns (each one is carried in its outcome as well)."""
    for index in range(count):
        branch.emit(SpawnRequest.model_construct(instruction=None))
        if index == count // 2:
            await asyncio.sleep(0.05)  # past the emission window: the first half travels live
    return "emitted"


def test_each_dropped_spawn_is_one_ledger_entry_also_across_an_executor_recovery(own, gauge):
    """e0..e3 each emit 250 invalid spawns (live, and again in their outcomes) and complete; h0 is
    held in flight; the executor is SIGKILLed and its replacement rebuilds the run from the log.

    Exactly 1,000 dropped_spawns entries, one per request (issue #32: 1,000 made 1,801), in the
    envelope and in the run log.
    """
    key = "drops-recovered"
    own.register_operation("emit_invalid", emit_invalid, record_turn=False)
    own.register_operation("held", held_operation(gauge), record_turn=False)
    builder = OperationGraphBuilder("drops")
    emitters = [builder.add_operation("emit_invalid", depends_on=[], count=250) for _ in range(4)]
    builder.add_operation("held", depends_on=[], key=key, label="h0")
    executor = own.runtime.executor
    progress = Progress()

    async def scenario():
        flow = asyncio.create_task(own.flow(builder.get_graph(), reactive=True, max_concurrent=5,
                                            on_progress=progress))
        await asyncio.wait_for(progress.wait_count("completed", 4), WAIT)
        await asyncio.wait_for(gauge.wait_entered.remote(key, 1), WAIT)
        kill(executor, "SIGKILL")
        await asyncio.wait_for(gauge.wait_entered.remote(key, 2), WAIT)  # h0 again, on the replacement
        await gauge.release.remote(key)
        return await flow

    envelope = run(scenario())

    assert own.runtime.executor._actor_id != executor._actor_id
    assert envelope["status"] == "completed"
    dropped = envelope["dropped_spawns"]
    assert len(dropped) == 1000, collections.Counter(entry["reason"] for entry in dropped)
    assert {entry["reason"] for entry in dropped} == {"invalid_request"}
    assert collections.Counter(entry["emitter_id"] for entry in dropped) == dict.fromkeys(emitters, 250)
    logged = RunLog(database_path()).load(envelope["run_id"])
    assert sum(record[0] == "dropped" for batch in logged.batches for record in batch) == 1000


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_durable_branch_store_is_replaced_with_every_acknowledged_message(own, gauge, how):
    """A chain's turns are recorded; the store is killed while the next node waits; the replacement
    reloads its shard: the default branch and every clone keep every message, nothing is lost."""
    key = f"durable-store-{how}"

    async def turn_then_wait(branch, step: str, **parameters):
        await branch.append({"role": "user", "content": step}, {"role": "assistant", "content": f"did {step}"})
        await gauge.enter.remote(key)
        await gauge.wait_released.remote(f"{key}/{step}")
        return await branch.messages()

    own.register_operation("turn_then_wait", turn_then_wait, record_turn=False)
    builder = OperationGraphBuilder("durable-store")
    first = builder.add_operation("turn_then_wait", step="first")
    builder.add_operation("turn_then_wait", depends_on=[first], inherit_context=True, step="second")

    async def scenario():
        flow = asyncio.create_task(own.flow(builder.get_graph()))
        await asyncio.wait_for(gauge.wait_entered.remote(key, 1), WAIT)
        before = await own.messages(own.default_branch)
        kill(own.runtime.stores[0], how)
        await asyncio.to_thread(wait_for_pool, own, "store_pool", lambda stores: stores["replacements"] >= 1
                                and stores["alive"] == 1)
        await gauge.release.remote(f"{key}/first")
        await asyncio.wait_for(gauge.wait_entered.remote(key, 2), WAIT)
        await gauge.release.remote(f"{key}/second")
        return before, await flow

    before, envelope = run(scenario())

    assert envelope["status"] == "completed" and "lost_branches" not in envelope
    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "did first"}]
    assert before == turns
    assert run(own.messages(own.default_branch)) == turns
    second = [node for node in envelope["operation_statuses"] if node != first][0]
    assert envelope["operation_results"][second] == [*turns, {"role": "user", "content": "second"},
                                                     {"role": "assistant", "content": "did second"}]


def test_an_append_its_store_wrote_before_dying_is_not_made_twice_on_the_replacement(session, tmp_path):
    """The store wrote an append and died before it answered: the caller sends the append again,
    with the same token, to a replacement on the same database, which appends nothing. A new
    token still appends. Without the token, chaos 15.2 found 606 and 614 of 600 messages."""
    from opgraph.actors import BranchStore

    database, owner = str(tmp_path / "branches.db"), f"owner-{uuid.uuid4().hex[:6]}"
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    dying = BranchStore.remote(0, database, owner)
    assert ray.get(dying.create.remote("b", [{"role": "system", "content": "s"}]))
    assert ray.get(dying.append.remote("b", turn, b"token-1")) == 3  # written; say its answer was lost
    os.kill(ray.get(dying.statistics.remote())["pid"], signal.SIGKILL)

    replacement = BranchStore.remote(0, database, owner)
    assert ray.get(replacement.append.remote("b", turn, b"token-1")) == 3  # the same append, sent again
    assert ray.get(replacement.append.remote("b", turn, b"token-2")) == 5  # another append
    assert ray.get(replacement.messages.remote("b")) == [{"role": "system", "content": "s"}, *turn, *turn]
    ray.kill(replacement)


@ray.remote
class StandInExecutor:
    """Just enough of an executor for a worker: the run's operations."""

    def __init__(self, operations: dict[str, Any]) -> None:
        self.operations = operations

    async def resources(self, key: str) -> Any:
        from opgraph.actors.protocol import RegisteredOperation, RunResources

        return RunResources(operations={name: RegisteredOperation(fn, record_turn=False)
                                        for name, fn in self.operations.items()})


def test_a_worker_adopted_by_another_executor_stops_streaming_to_the_one_before(gauge):
    """Two calls of a stream are held; the same executor introduces itself again (nothing changes),
    then another adopts the worker: once released, the old stream ends without sending its outcomes
    (a dead executor's stream would hold the worker's loop), and the worker counts them orphaned."""
    from opgraph.actors.workers.worker import OperationWorker

    key = f"orphaned-{uuid.uuid4().hex[:6]}"
    first = StandInExecutor.remote({"held": held_operation(gauge)})
    second = StandInExecutor.remote({"held": held_operation(gauge)})
    worker = OperationWorker.remote(0, [], [], first, "opgraph-worker-test")

    async def scenario() -> list[Any]:
        calls = [(f"n{i}", 1, "held", {"key": key, "label": f"n{i}"}, None, 0) for i in range(2)]
        stream = worker.run_batch.options(num_returns="streaming").remote("run-orphaned", calls)
        items = [await (await stream.__anext__())]  # ACKNOWLEDGED
        await gauge.wait_entered.remote(key, 2)
        await worker.set_executor.remote(first)
        assert (await worker.statistics.remote())["orphaned"] == 0
        await worker.set_executor.remote(second)
        await gauge.release.remote(key)
        async for ref in stream:
            items.append(await ref)
        return items

    try:
        items = run(scenario())
        assert len(items) == 1  # the acknowledgement only: no outcome went to the executor before
        assert ray.get(worker.statistics.remote())["orphaned"] == 2
    finally:
        for handle in (worker, first, second):
            ray.kill(handle)
