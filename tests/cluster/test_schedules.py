"""Schedules on SQLite and PostgreSQL under a fake clock: cadence, DST, overlap policies, catch-up, jitter,
pause, trigger, backfill, limits, and two schedulers (or a killed one) firing each key once.

    schedule --tick--> fire (schedule, nominal) UNIQUE --same transaction--> task queued | held | skipped
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from control_clock import FakeClock

from opgraph.cluster.control import (
    OVERLAP_POLICIES,
    BackfillTooLargeError,
    ControlDatabase,
    ControlError,
    ControlInputError,
    CronError,
    ScheduleNotFoundError,
    TaskQueue,
    UnknownActionKindError,
)
from opgraph.cluster.control.cadence import Cadence, jitter_offset
from opgraph.cluster.control.schedules import Scheduler

NY = "America/New_York"
START = datetime(2027, 1, 4, 12, 0, tzinfo=UTC).timestamp()  # a Monday, on the minute


def utc(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()


@pytest.fixture
def clock():
    return FakeClock(START)


@pytest.fixture
def scheduler(database_target, clock):
    database = ControlDatabase(database_target, clock=clock)
    yield Scheduler(database, name="s1", max_backfill=50)
    database.close()


def walk(scheduler, clock, seconds: float, step: float = 10.0) -> None:
    end = clock.now + seconds
    while clock.now < end:
        clock.advance(min(step, end - clock.now))
        scheduler.tick()


# -- cadence (pure) -------------------------------------------------------------------------------
def test_schedule_cadence_dst_gap_fires_shifted_forward_once():
    """New York, 2026-03-08: 02:00 jumps to 03:00. A daily 02:30 fires at 03:30 EDT; */30 gives each instant once."""
    daily = Cadence(cron="30 2 * * *", timezone=NY).times(utc(2026, 3, 7, 12), utc(2026, 3, 9, 12))
    assert daily == [utc(2026, 3, 8, 7, 30), utc(2026, 3, 9, 6, 30)]  # 03:30 EDT, then 02:30 EDT
    half = Cadence(cron="*/30 * * * *", timezone=NY).times(utc(2026, 3, 8, 6, 15), utc(2026, 3, 8, 8, 0))
    assert half == [utc(2026, 3, 8, 6, 30), utc(2026, 3, 8, 7, 0), utc(2026, 3, 8, 7, 30), utc(2026, 3, 8, 8, 0)]


def test_schedule_cadence_dst_repeat_fires_once_at_the_first_occurrence():
    """New York, 2026-11-01: 01:00-02:00 happens twice. A daily 01:30 fires once, at 01:30 EDT."""
    assert Cadence(cron="30 1 * * *", timezone=NY).times(utc(2026, 11, 1, 0), utc(2026, 11, 1, 12)) == \
        [utc(2026, 11, 1, 5, 30)]
    hourly = Cadence(cron="0 * * * *", timezone=NY).times(utc(2026, 11, 1, 4, 30), utc(2026, 11, 1, 8, 0))
    assert hourly == [utc(2026, 11, 1, 5), utc(2026, 11, 1, 7), utc(2026, 11, 1, 8)]


def test_schedule_interval_ignores_wall_clocks_and_bad_cadences_are_refused():
    assert Cadence(interval=3600, timezone=NY, anchor=utc(2026, 3, 8, 5)).times(
        utc(2026, 3, 8, 5), utc(2026, 3, 8, 8)) == [utc(2026, 3, 8, 6), utc(2026, 3, 8, 7), utc(2026, 3, 8, 8)]
    with pytest.raises(CronError, match="bad cron expression"):
        Cadence(cron="61 * * * *")
    with pytest.raises(CronError, match="unknown time zone 'Mars/Olympus'"):
        Cadence(cron="* * * * *", timezone="Mars/Olympus")
    with pytest.raises(CronError, match="positive number of seconds"):
        Cadence(interval=0)
    with pytest.raises(CronError, match="never fires"):
        Cadence(cron="0 0 30 2 *")
    assert jitter_offset("s1", 10.0, 30) == jitter_offset("s1", 10.0, 30) < 30


# -- schedules on both databases -----------------------------------------------------------------
def test_schedule_bad_input_is_refused_with_the_field(scheduler):
    with pytest.raises(CronError):
        scheduler.add("x", action_kind="workflow", target="t", cron="not a cron")
    with pytest.raises(CronError):
        scheduler.add("x", action_kind="workflow", target="t", cron="* * * * *", timezone="Nowhere/Land")
    with pytest.raises(UnknownActionKindError):
        scheduler.add("x", action_kind="shell", target="t", cron="* * * * *")
    with pytest.raises(ControlInputError, match="overlap"):
        scheduler.add("x", action_kind="workflow", target="t", cron="* * * * *", overlap="sometimes")
    with pytest.raises(ScheduleNotFoundError):
        scheduler.get("nope")
    assert scheduler.list_schedules() == []


def test_schedule_fires_on_cadence_with_jitter_and_stops_at_its_action_limit(scheduler, clock):
    schedule = scheduler.add("every-minute", action_kind="workflow", target="triage", cron="* * * * *",
                             overlap="allow_all", jitter=20, max_actions=3)
    walk(scheduler, clock, 300)
    fires = scheduler.fires(schedule.schedule_id)
    assert [fire.status for fire in fires] == ["fired"] * 3
    tasks = scheduler.queue.list_tasks(schedule_id=schedule.schedule_id)
    assert len(tasks) == 3
    for task in tasks:
        assert task.nominal_at <= task.available_at < task.nominal_at + 20
        assert task.available_at == task.nominal_at + jitter_offset(schedule.schedule_id, task.nominal_at, 20)
    assert scheduler.get("every-minute").remaining_actions == 0


def test_schedule_end_time_and_pause_with_note(scheduler, clock):
    schedule = scheduler.add("until", action_kind="workflow", target="t", interval=60, overlap="allow_all",
                             end_at=START + 150)
    walk(scheduler, clock, 60)
    paused = scheduler.pause("until", note="maintenance window")
    assert paused.paused and paused.note == "maintenance window"
    walk(scheduler, clock, 60)
    unpaused = scheduler.unpause("until", note="back")
    assert not unpaused.paused and unpaused.note == "back"
    walk(scheduler, clock, 600)
    nominal = sorted(fire.nominal_at for fire in scheduler.fires(schedule.schedule_id))
    assert nominal == [START + 60]  # 120 fell while paused (not taken up); 180 is past the end time


def test_schedule_catch_up_window_fires_recent_misses_late_and_skips_older_ones(scheduler, clock):
    schedule = scheduler.add("catchup", action_kind="workflow", target="t", cron="* * * * *",
                             overlap="allow_all", catchup_window=150)
    clock.advance(600)  # the scheduler was down for ten minutes
    counts = scheduler.tick()
    fires = {fire.nominal_at: fire for fire in scheduler.fires(schedule.schedule_id)}
    assert counts == {"fired": 3, "buffered": 0, "skipped": 7}
    late = [fire for fire in fires.values() if fire.status == "fired"]
    assert sorted(fire.lateness for fire in late) == [0.0, 60.0, 120.0]
    skipped = [fire for fire in fires.values() if fire.status == "skipped"]
    assert all("beyond the catch-up window of 150 s" in fire.reason for fire in skipped)
    assert scheduler.tick() == {"fired": 0, "buffered": 0, "skipped": 0}


@pytest.mark.parametrize("policy", OVERLAP_POLICIES)
def test_schedule_overlap_policies(scheduler, clock, policy):
    """Three fires while the first fire's task is leased (a worker holds it), then that task ends."""
    schedule = scheduler.add(f"o-{policy}", action_kind="workflow", target="t", interval=60, overlap=policy)
    queue = scheduler.queue
    walk(scheduler, clock, 60)
    first = queue.claim("default", "worker", lease_seconds=10_000)
    assert first is not None
    walk(scheduler, clock, 180)
    fires = sorted(scheduler.fires(schedule.schedule_id), key=lambda fire: fire.nominal_at)
    statuses = [fire.status for fire in fires]
    tasks = {task.task_id: task for task in queue.list_tasks(schedule_id=schedule.schedule_id)}
    expected = {"skip": ["fired", "skipped", "skipped", "skipped"],
                "buffer_one": ["fired", "buffered", "skipped", "skipped"],
                "buffer_all": ["fired", "buffered", "buffered", "buffered"],
                "cancel_other": ["fired", "buffered", "buffered", "buffered"],
                "terminate_other": ["fired", "fired", "fired", "fired"],
                "allow_all": ["fired", "fired", "fired", "fired"]}[policy]
    if policy == "cancel_other":
        # Each fire asks the worker to stop and waits for it; a newer fire supersedes the waiting one.
        assert queue.get(first.task.task_id).cancel_requested == 1
        assert [tasks[fire.task_id].state for fire in fires[1:]] == ["cancelled", "cancelled", "queued"]
        queue.cancelled_by_worker(first, "stopped as asked")
        assert queue.claim("default", "worker").task.task_id == fires[3].task_id
    assert statuses == expected
    if policy == "terminate_other":
        assert queue.get(first.task.task_id).state == "cancelled"
        assert [task.state for task in tasks.values()].count("queued") == 1
    if policy in ("buffer_one", "buffer_all"):
        queue.succeed(first)
        nxt = queue.claim("default", "worker")
        assert nxt is not None and nxt.task.task_id == fires[1].task_id  # the buffered fire, in order
    if policy == "skip":
        assert "overlap skip: task" in fires[1].reason


def test_schedule_trigger_now_and_backfill_obey_overlap_and_the_maximum(scheduler, clock):
    schedule = scheduler.add("bf", action_kind="workflow", target="t", cron="*/5 * * * *", overlap="skip")
    fire = scheduler.trigger("bf")
    assert fire.kind == "manual" and fire.status == "fired"
    second = scheduler.trigger("bf")
    assert second.status == "skipped" and "overlap skip" in second.reason
    with pytest.raises(BackfillTooLargeError) as refused:
        scheduler.backfill("bf", START - 86400, START)
    assert refused.value.limit == 50 and refused.value.fires > 50
    allowing = scheduler.add("bf2", action_kind="workflow", target="t", cron="*/5 * * * *", overlap="allow_all")
    result = scheduler.backfill("bf2", START - 3600, START - 1)
    assert result["fired"] == 12
    assert scheduler.backfill("bf2", START - 3600, START - 1)["already_fired"] == 12
    skipping = scheduler.backfill("bf", START - 3600, START - 1)
    assert skipping["fired"] == 0 and skipping["skipped"] == 12  # the triggered task is still queued
    assert len(scheduler.queue.list_tasks(schedule_id=allowing.schedule_id)) == 12
    assert schedule.schedule_id != allowing.schedule_id


def test_schedule_two_schedulers_fire_each_key_once(database_target, clock):
    """Two schedulers, each with its own connection, tick the same database from two threads."""
    first = Scheduler(ControlDatabase(database_target, clock=clock), name="a")
    second = Scheduler(ControlDatabase(database_target, clock=clock), name="b")
    for index in range(5):
        first.add(f"s{index}", action_kind="workflow", target="t", cron="* * * * *", overlap="allow_all",
                  catchup_window=3600)
    clock.advance(1800)
    barrier = threading.Barrier(2)

    def run(scheduler):
        barrier.wait()
        for _ in range(3):
            scheduler.tick()

    threads = [threading.Thread(target=run, args=(scheduler,)) for scheduler in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    tasks = first.queue.list_tasks(limit=1000)
    keys = [(task.schedule_id, task.nominal_at) for task in tasks]
    assert len(keys) == len(set(keys)) == 5 * 30
    for scheduler in (first, second):
        scheduler.db.close()


def test_schedule_scheduler_killed_mid_fire_loses_and_doubles_nothing(database_target, clock):
    """The fire, its task and the cursor commit together: a scheduler dying between them leaves none."""
    dying = Scheduler(ControlDatabase(database_target, clock=clock), name="dying")
    schedule = dying.add("k", action_kind="workflow", target="t", interval=60, overlap="allow_all")

    def die(connection, transition):
        raise SystemExit("killed mid-fire")

    dying.db.transition_hooks.append(die)
    clock.advance(61)
    with pytest.raises(SystemExit):
        dying.tick()
    dying.db.close()
    survivor = Scheduler(ControlDatabase(database_target, clock=clock), name="survivor")
    assert survivor.fires("k") == [] and survivor.queue.list_tasks() == []
    survivor.tick()
    (fire,) = survivor.fires("k")
    assert fire.status == "fired" and fire.scheduler == "survivor" and fire.nominal_at == START + 60
    assert len(survivor.queue.list_tasks(schedule_id=schedule.schedule_id)) == 1
    survivor.db.close()


def test_schedule_delete_keeps_history(scheduler, clock):
    scheduler.add("gone", action_kind="workflow", target="t", interval=60)
    walk(scheduler, clock, 60)
    scheduler.delete("gone")
    with pytest.raises(ScheduleNotFoundError):
        scheduler.get("gone")
    assert len(scheduler.queue.list_tasks()) == 1
    assert isinstance(ScheduleNotFoundError("x"), ControlError)
    assert TaskQueue(scheduler.db).statistics()["depth"]
