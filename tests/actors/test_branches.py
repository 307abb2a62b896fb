"""Branches across processes: clone isolation, primary inheritance and the branch hooks.

Operations read and write their branch through the BranchStore actor; the driver reads
it back with ``session.messages`` or the ``BranchView`` handed to ``on_branch_created``.
Each test runs on a fresh default branch so that earlier tests cannot leak into it.
"""

from __future__ import annotations

from typing import Any

from running import run

from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder, SpawnRequest

SEED = {"role": "system", "content": "seed"}


def turn(instruction: str, response: Any) -> list[dict[str, Any]]:
    """The two messages a worker records for one operation (record_turn=True)."""
    return [{"role": "user", "content": instruction}, {"role": "assistant", "content": response}]


class BranchesCreated:
    """on_branch_created: remember each BranchView by the node it was made for."""

    def __init__(self) -> None:
        self.views: dict[str, Any] = {}

    def __call__(self, view: Any) -> None:
        assert view.node_id not in self.views, "one clone per node"
        self.views[view.node_id] = view


async def history_then_note(branch: Any, note: str = "", **parameters: Any) -> list[Any]:
    """Return the branch's history at start, then append a private note to it."""
    history = await branch.messages()
    if note:
        await branch.append({"role": "note", "content": note})
    return history


def test_a_clone_never_writes_into_its_parent(session):
    """root -> dependent, flow default branch ``parent`` (seeded): root runs on ``parent``; the
    dependent runs on a clone of the Session's default branch (ADR-0023 D3: the flow's
    default branch serves roots only), takes notes there, and ``parent`` never sees them."""
    with Session() as own:
        own.register_operation("history_then_note", history_then_note)
        parent = own.new_branch(messages=[SEED])
        builder = OperationGraphBuilder("isolation")
        root = builder.add_operation("history_then_note", instruction="root step")
        dependent = builder.add_operation("history_then_note", instruction="dependent step", note="private")
        created = BranchesCreated()

        async def scenario() -> tuple[dict[str, Any], list[Any], list[Any], list[Any]]:
            envelope = await own.flow(builder.get_graph(), default_branch=parent, on_branch_created=created)
            return (envelope, await own.messages(parent), await created.views[dependent].messages(),
                    await own.messages(own.default_branch))

        envelope, parent_messages, clone_messages, session_messages = run(scenario())

    results = envelope["operation_results"]
    assert set(created.views) == {dependent}
    assert created.views[dependent].id not in (parent, own.default_branch)
    assert created.views[dependent].reactive is False
    assert parent_messages == [SEED, *turn("root step", results[root])]
    # Cloned from the Session's default branch, which was empty: the seed is not inherited.
    assert results[dependent] == []
    assert clone_messages == [{"role": "note", "content": "private"}, *turn("dependent step", results[dependent])]
    assert all(message.get("content") != "private" for message in parent_messages)
    assert session_messages == []


def test_inherit_context_starts_from_the_primary_predecessor_history(session):
    """root -> a -> b (inherit_context from a): b starts with exactly a's conversation.

    ``a`` is cloned from the Session's default branch (fresh, so empty), never from the
    flow's default branch ``parent``, whose seed only the root sees."""
    with Session() as own:
        own.register_operation("history_then_note", history_then_note)
        parent = own.new_branch(messages=[SEED])
        builder = OperationGraphBuilder("inheritance")
        root = builder.add_operation("history_then_note", instruction="root step")
        a = builder.add_operation("history_then_note", depends_on=[root], instruction="a step", note="a's notes")
        b = builder.add_operation("history_then_note", depends_on=[a], inherit_context=True, instruction="b step")
        created = BranchesCreated()

        async def scenario() -> tuple[dict[str, Any], list[Any], list[Any]]:
            envelope = await own.flow(builder.get_graph(), default_branch=parent, on_branch_created=created)
            return envelope, await created.views[a].messages(), await created.views[b].messages()

        envelope, a_messages, b_messages = run(scenario())

    results = envelope["operation_results"]
    assert results[root] == [SEED]
    a_history = [{"role": "note", "content": "a's notes"}, *turn("a step", results[a])]
    assert a_messages == a_history  # b's own turn never reached a's branch
    assert results[b] == a_history
    assert b_messages == [*a_history, *turn("b step", results[b])]


def test_branch_hooks_fire_for_preallocated_and_reactive_clones(session):
    """planner => helper (spawned), planner -> reviewer: both clones are announced.

    The reviewer's clone is preallocated (reactive False); the helper's is made when its
    spawn is admitted (reactive True) and ``spawn_branch_setup`` writes into it before
    the helper starts.
    """

    async def plan(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"plan": "delegate", "spawn": SpawnRequest(instruction="help out")}

    def spawn_branch_setup(child: Any, branch: Any) -> None:
        branch.append({"role": "system", "content": f"setup for {child.parameters['instruction']}"})

    session.register_operation("plan_and_delegate", plan, record_turn=False)
    session.register_operation("operate", history_then_note, record_turn=False)
    session.register_operation("review", history_then_note, record_turn=False)
    parent = session.new_branch(messages=[SEED])
    builder = OperationGraphBuilder("hooks")
    planner = builder.add_operation("plan_and_delegate", instruction="plan the work")
    reviewer = builder.add_operation("review", instruction="review")
    graph = builder.get_graph()
    created = BranchesCreated()

    async def scenario() -> tuple[dict[str, Any], list[Any]]:
        envelope = await session.flow(graph, default_branch=parent, reactive=True, on_branch_created=created,
                                      spawn_branch_setup=spawn_branch_setup)
        return envelope, await session.messages(parent)

    envelope, parent_messages = run(scenario())

    [helper] = [node_id for node_id in envelope["operation_statuses"] if node_id not in graph.nodes]
    assert set(created.views) == {reviewer, helper}
    assert created.views[reviewer].reactive is False
    assert created.views[helper].reactive is True
    assert created.views[helper].id not in (parent, created.views[reviewer].id)
    assert envelope["operation_statuses"][planner] == "completed"
    assert envelope["operation_results"][helper] == [SEED, {"role": "system", "content": "setup for help out"}]
    assert parent_messages == [SEED]  # the setup wrote into the helper's clone only


def test_a_store_serves_reads_and_appends_of_several_operations_in_one_message(session):
    """``BranchStore.serve`` (a worker's gathered calls): each call answered on its own, in order; an
    unknown branch fails its call only; a second read of unchanged messages comes back as the
    index of the first; an append sent twice with its token is made once."""
    import ray

    from opgraph.actors import BranchStore
    from opgraph.actors.errors import UnknownBranchError

    store = BranchStore.remote(0)
    ray.get(store.create.remote("a", [SEED]))
    note = {"role": "note", "content": "n"}
    answers = ray.get(store.serve.remote([
        ("messages", "a"), ("append", "a", [note], b"t1"), ("messages", "a"), ("messages", "a"),
        ("messages", "missing"), ("append", "a", [note], b"t1"), ("append", "missing", [note], b"t2")]))

    assert answers[:4] == [(True, [SEED]), (True, 2), (True, [SEED, note]), (True, 2)]
    assert answers[4][0] is False and isinstance(answers[4][1], UnknownBranchError)
    assert answers[5] == (True, 2)  # the same token: not appended again
    assert answers[6][0] is False and isinstance(answers[6][1], UnknownBranchError)
    assert ray.get(store.messages.remote("a")) == [SEED, note]
    ray.kill(store)


def test_operations_read_and_append_their_branches_through_the_workers_direct_channels(session):
    """Operations reading and writing branches together reach their store in gathered messages over
    the workers' direct channels; each reads a history no other operation's note has reached."""
    import ray

    width = 12
    session.register_operation("history_then_note", history_then_note, record_turn=False)

    def direct() -> int:
        return sum(ray.get(worker.statistics.remote())["branch_calls_direct"] for worker in session.runtime.workers)

    before = direct()
    parent = session.new_branch(messages=[SEED])
    builder = OperationGraphBuilder("gathered")
    for index in range(width):
        builder.add_operation("history_then_note", note=f"note {index}")
    envelope = run(session.flow(builder.get_graph(), default_branch=parent))

    assert envelope["status"] == "completed"
    assert all(result in ([], [SEED]) for result in envelope["operation_results"].values())
    assert direct() > before
