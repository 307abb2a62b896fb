"""A fed run end to end on the actors: admitted in batches, drained, released, closed, recovered.

    FedRun.start (empty, kept open) <- admit 3 x 40 rows ... outcomes -> release ... close -> envelope

The executor holds only what is not released: its node count stays at the rows in flight
plus those settled and not yet released, whatever the run admitted over its life. Killed
with outcomes undelivered, the run is rebuilt on a replacement, and ``held()`` gives the
feeder what it had not seen.
"""

from __future__ import annotations

import asyncio

import ray

from opgraph.actors import FedRun
from opgraph.kernel import Operation

TIMEOUT = 60.0


async def echo(branch, prompt: str = "", **parameters):
    await asyncio.sleep(0.01)
    return {"echo": prompt, "branch": branch.id}


def rows(start: int, count: int) -> list:
    made = []
    for index in range(start, start + count):
        made.append(Operation(id=f"row-{index}", operation="echo", parameters={"prompt": f"row {index}"},
                              metadata={"stateless": True, "reference_id": str(index)}))
    return made


async def drain(fed: FedRun, expected: int) -> dict[str, object]:
    seen: dict[str, object] = {}
    while len(seen) < expected:
        for event in await fed.outcomes(timeout=1.0):
            seen[event.name] = event.result
    return seen


def test_a_fed_run_admits_in_batches_releases_what_was_recorded_and_ends_when_closed(session):
    session.register_operation("echo", echo, record_turn=False)

    async def scenario():
        fed = await FedRun.start(session, max_concurrent=8)
        decided = await fed.admit(rows(0, 40))
        assert decided == [(True, None)] * 40
        again = await fed.admit(rows(0, 1))  # the same row: already in the run
        assert again == [(False, "duplicate")]
        answered = {}
        for start in (40, 80):
            batch = await drain(fed, 40)
            answered.update(batch)
            released = await fed.release([event_id for event_id in await _ids(fed)])
            assert released == 40
            status = await fed.control.status()
            assert status["nodes"] == 0  # every admitted row settled and was let go
            await fed.admit(rows(start, 40))
        answered.update(await drain(fed, 40))
        assert await fed.close()
        while not fed.done:
            await fed.outcomes(timeout=1.0)
        await fed.forget()
        return answered, fed.envelope

    answered, envelope = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert sorted(answered, key=int) == [str(index) for index in range(120)]
    assert all(result["branch"] is None for result in answered.values())  # stateless: no branch
    assert envelope["status"] == "completed"
    assert envelope["released_operations"] == {"completed": 80}
    assert len(envelope["operation_statuses"]) == 40


async def _ids(fed: FedRun) -> list[str]:
    held = await fed.held()
    assert held.open == []
    return [event.operation_id for event in held.settled]


def test_a_fed_run_whose_executor_died_is_rebuilt_and_held_gives_what_was_not_delivered(session):
    session.register_operation("echo", echo, record_turn=False)

    async def scenario():
        fed = await FedRun.start(session, max_concurrent=4)
        await fed.admit(rows(0, 30))
        first = await fed.outcomes(timeout=5.0)
        await fed.release([event.operation_id for event in first])
        ray.kill(fed.following.executor, no_restart=True)
        held = await fed.held()  # follows the run to the replacement, rebuilt from the log
        seen = {event.name for event in first} | {event.name for event in held.settled}
        await fed.release([event.operation_id for event in held.settled])
        while len(seen) < 30:
            seen |= {event.name for event in await fed.outcomes(timeout=1.0)}
        await fed.close()
        while not fed.done:
            await fed.outcomes(timeout=1.0)
        await fed.forget()
        return seen, fed.recoveries, fed.envelope

    seen, recoveries, envelope = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert seen == {str(index) for index in range(30)}
    assert recoveries == 1
    assert envelope["status"] == "completed"


def test_calls_that_meet_the_same_executor_death_all_wait_for_the_rebuilt_run(session):
    """The feeder's admission, its poll and its reconciliation die together and each starts the
    replacement: none of them may be answered before the run is rebuilt there (an admission
    answered early was refused as ``not_running``, and a 100,000-row job stopped short)."""
    session.register_operation("echo", echo, record_turn=False)

    async def scenario():
        fed = await FedRun.start(session, max_concurrent=50)
        await fed.admit(rows(0, 400))  # a log long enough that its rebuilding takes a while
        settled = 0
        while settled < 400:
            settled += len(await fed.outcomes(timeout=1.0))
        ray.kill(fed.following.executor, no_restart=True)
        decided, polled, held = await asyncio.gather(fed.admit(rows(400, 20)), fed.outcomes(timeout=0.5),
                                                     fed.held())
        seen = {event.name for event in [*polled, *held.settled]}
        while len(seen) < 420:
            seen |= {event.name for event in await fed.outcomes(timeout=1.0)}
        await fed.close()
        while not fed.done:
            await fed.outcomes(timeout=1.0)
        await fed.forget()
        return decided, seen, fed.envelope

    decided, seen, envelope = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    # Accepted here, or by the dying executor before it went (its log has them: a duplicate now).
    assert set(decided) <= {(True, None), (False, "duplicate")}, decided
    assert seen >= {str(index) for index in range(400, 420)}
    assert envelope["status"] == "completed"
