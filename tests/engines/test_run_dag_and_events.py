"""ADR-0034 D6 (run_dag delegates to Session.flow) and durable, bounded event history (delta 1).

    run_dag(graph) -> Session.flow(graph) -> envelope; node signals -> dag_progress records
    every record -> EventLog (bounded in memory) -> EventSink (all of them)
"""

from __future__ import annotations

import sqlite3

import pytest
from engine_scripts import ByAgent, Note, ScriptEngine, kinds
from running import run_engine as run

from opgraph.cluster.store import EngineRunStore
from opgraph.engines import EventSinkError, MemorySink
from opgraph.kernel import TaskAssignment, build_dag_graph

pytestmark = pytest.mark.ray


def test_run_dag_delegates_to_flow_and_records_each_node_before_returning(session, model, sink):
    async def body(run_):
        writer = await run_.make_agent("writer")
        graph, ids = build_dag_graph([TaskAssignment(task="draft", assignee="writer"),
                                      TaskAssignment(task="polish", assignee="writer", depends_on=["1"])],
                                     {"writer": writer.id}, operation="chat")
        for node in graph.nodes.values():
            node.parameters.pop("inputs")
            node.parameters["model"] = writer.model
        envelope = await run_.run_dag(graph, max_concurrent=2)
        settled = {r.data["node_id"] for r in run_.events.notifications("dag_progress")
                   if r.data["status"] == "completed"}
        assert settled == set(ids)  # drained before run_dag returned
        return envelope["status"]

    engine = ScriptEngine(body, model=model(ByAgent(default="text")), event_sink=sink)
    assert run(engine.run(session=session)) == "completed"


def emit_notes(count):
    async def body(run_):
        for index in range(count):
            run_.emit(Note(text=str(index)))
        return "emitted"
    return body


def test_in_memory_history_is_bounded_and_the_sink_keeps_everything(session, sink):
    engine = ScriptEngine(emit_notes(12), max_retained_events=5, event_sink=sink)
    result = run(engine.run(session=session))
    assert [n.text for n in result.run.by_type(Note)] == ["7", "8", "9", "10", "11"]
    assert result.run.events.statistics()["evicted_events"] == 7
    assert [r.data["text"] for r in kinds(sink, result.run, "Note")] == [str(i) for i in range(12)]


def test_notifications_are_bounded_separately(session, sink):
    async def body(run_):
        for index in range(20):
            run_.notify("tick", index=index)
        return "ok"

    result = run(ScriptEngine(body, max_retained_notifications=4, event_sink=sink).run(session=session))
    assert len(result.run.events.notifications()) == 4
    assert len(kinds(sink, result.run, "tick")) == 20


class BrokenSink(MemorySink):
    def record_events(self, run_id, records):
        raise sqlite3.OperationalError("disk I/O error")


def test_a_sink_that_cannot_record_fails_the_run_loudly(session):
    with pytest.raises(EventSinkError, match="disk I/O error"):
        run(ScriptEngine(emit_notes(3), event_sink=BrokenSink()).run(session=session))


def test_the_store_holds_every_record_of_a_run_on_either_backend(session, model, database_target):
    store = EngineRunStore(database_target)
    try:
        async def body(run_):
            agent = await run_.make_agent("worker", name="noter", emits=(Note,))
            await run_.operate_with_repair(agent, "note", arrived=lambda: bool(run_.by_type(Note)))
            return "noted"

        engine = ScriptEngine(body, model=model(ByAgent(default='{"note": [{"text": "kept"}]}')), event_sink=store)
        result = run(engine.run(session=session))
        record = store.get_run(result.run.run_id)
        events = store.events(result.run.run_id)
        assert (record.engine, record.status, record.result) == ("script", "completed", "noted")
        assert [e["seq"] for e in events] == list(range(1, result.run.events.seq + 1))
        note = next(e for e in events if e["type"] == "Note")
        assert (note["kind"], note["agent"], note["data"]) == ("event", "noter", {"text": "kept"})
        assert record.statistics["budget"]["agents_made"] == 1
        assert store.statistics()["script"]["agents_made"] == 1  # read from the JSON column by the database
        assert [r.run_id for r in store.list_runs(engine="script")] == [result.run.run_id]
    finally:
        store.close()


def test_each_turn_records_the_turns_it_came_after(session, model, sink):
    """a(1) -spawn-> b(2), c(3) (each after 1) -> quiescence -> d(4) (after 1, 2, 3):
    the record implies the run's critical path."""
    async def body(run_):
        first = await run_.make_agent("worker", name="a")
        await run_.turn(first, "start")

        async def branch(name):
            agent = await run_.make_agent("worker", name=name)
            await run_.turn(agent, f"{name} works")

        run_.spawn(branch("b"))
        run_.spawn(branch("c"))
        await run_.wait_quiescence()
        await run_.turn(await run_.make_agent("worker", name="d"), "join")
        return "done"

    result = run(ScriptEngine(body, model=model(ByAgent(default="ok")), event_sink=sink).run(session=session))
    turns = {r.agent: r.data for r in kinds(sink, result.run, "turn_completed")}
    assert turns["a"]["turn"] == 1 and turns["a"]["after"] == []
    assert turns["b"]["after"] == turns["c"]["after"] == [1]
    assert {turns["b"]["turn"], turns["c"]["turn"]} == {2, 3}
    assert sorted(turns["d"]["after"]) == [1, 2, 3] and turns["d"]["turn"] == 4
