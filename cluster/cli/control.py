"""`opgraph schedule ...`, `opgraph task ...` and `opgraph worker`: the control plane from a terminal.

Owns their arguments, printing (a table, or ``--json``) and exit codes. Producing commands go
through the queue and the schedules (``opgraph.cluster.control``) and never import an action
adapter; `opgraph worker` runs the worker, which loads the adapters by ``action_kind``. Bad input
(a cron, a time zone, an action kind, a workflow that does not exist) is refused before anything
is written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any

from opgraph.kernel import OpGraphError

from ..command_line import DEFAULT_MODEL, JSON, NAMESPACE, RAY_ADDRESS, STORE, ExitCode, add_options, positive_int
from .spine import command_group, refused, subcommand

__all__ = ["add_control_parsers"]

CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE)


def _open(arguments: argparse.Namespace) -> Any:
    from ..control import ControlDatabase
    from ..control.outbox import deliver_task_transitions

    return deliver_task_transitions(ControlDatabase(arguments.store))


def _when(text: str) -> float:
    """An ISO 8601 time (UTC when it names no zone) or seconds since the epoch."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time or epoch seconds: {text!r}") from exc
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _iso(value: float | None) -> str:
    return "-" if value is None else datetime.fromtimestamp(value, UTC).isoformat(timespec="seconds")


def _payload(arguments: argparse.Namespace) -> dict[str, Any]:
    from ..control import ControlInputError
    from ..lanes import parse_inputs

    payload: dict[str, Any] = {}
    if arguments.payload:
        try:
            payload = json.loads(arguments.payload)
        except json.JSONDecodeError as exc:
            raise ControlInputError(f"--payload is not JSON: {exc}", field="payload") from exc
        if not isinstance(payload, dict):
            raise ControlInputError("--payload must be a JSON object", field="payload")
    if arguments.input:
        payload.setdefault("inputs", {}).update(parse_inputs(arguments.input))
    if getattr(arguments, "model", None):
        payload["model"] = arguments.model
    return payload


def _checked_payload(arguments: argparse.Namespace) -> dict[str, Any]:
    """The action's payload, once its target is checked against the store (it must exist there)."""
    from ..control.admission import check_target
    from ..lanes import open_store

    payload = _payload(arguments)
    with open_store(arguments.store) as store:
        check_target(arguments.action, arguments.target, store)
    return payload


def _emit(arguments: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2, default=str) if arguments.json else text)


def _guarded(action: Any) -> Any:
    def handler(arguments: argparse.Namespace) -> int:
        from ..control import ControlError, ControlInputError, ScheduleNotFoundError, TaskNotFoundError
        from ..store import WorkflowNotFoundError, WorkflowStoreError

        try:
            return action(arguments)
        except (ControlInputError, WorkflowNotFoundError, argparse.ArgumentTypeError) as exc:
            print(f"opgraph {arguments.command}: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        except (ScheduleNotFoundError, TaskNotFoundError, ControlError, WorkflowStoreError) as exc:
            return refused(f"opgraph {arguments.command}", exc)
        except OpGraphError as exc:
            return refused(f"opgraph {arguments.command}", exc, ExitCode.USAGE)
    return handler


# -- schedule --------------------------------------------------------------------------------
def _schedule_add(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    payload = _checked_payload(arguments)
    with _open(arguments) as database:
        record = Scheduler(database).add(
            arguments.name, action_kind=arguments.action, target=arguments.target, cron=arguments.cron,
            interval=arguments.every, timezone=arguments.timezone, payload=payload, queue=arguments.queue,
            priority=arguments.priority, max_attempts=arguments.max_attempts, overlap=arguments.overlap,
            catchup_window=arguments.catchup_window, jitter=arguments.jitter, start_at=arguments.start,
            end_at=arguments.end, max_actions=arguments.max_actions, paused=arguments.paused, note=arguments.note)
    _emit(arguments, record.to_dict(), f"schedule {record.name} ({record.schedule_id}) added")
    return ExitCode.OK


def _schedule_list(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    with _open(arguments) as database:
        scheduler = Scheduler(database)
        records = scheduler.list_schedules()
        rows = [{**record.to_dict(), "next": scheduler.next_times(record, 1)} for record in records]
    lines = [f"{'NAME':<24} {'CADENCE':<18} {'ZONE':<18} {'OVERLAP':<16} {'STATE':<8} NEXT"]
    for row in rows:
        cadence = row["cron"] or f"every {row['interval_seconds']:g}s"
        state = "paused" if row["paused"] else "active"
        lines.append(f"{row['name']:<24} {cadence:<18} {row['timezone']:<18} {row['overlap']:<16} {state:<8} "
                     f"{_iso(row['next'][0]) if row['next'] else '-'}")
    _emit(arguments, rows, "\n".join(lines))
    return ExitCode.OK


def _schedule_show(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    with _open(arguments) as database:
        scheduler = Scheduler(database)
        record = scheduler.get(arguments.name)
        fires = scheduler.fires(arguments.name, limit=arguments.limit)
        upcoming = scheduler.next_times(record, 5)
    payload = {**record.to_dict(), "next": upcoming, "fires": [fire.to_dict() for fire in fires]}
    lines = [f"{key}: {value}" for key, value in record.to_dict().items()]
    lines.append("next: " + ", ".join(_iso(when) for when in upcoming))
    lines += [f"fire {_iso(fire.nominal_at)} {fire.kind:<9} {fire.status:<8} {fire.task_id or '-'} "
              f"{fire.reason or ''}" for fire in fires]
    _emit(arguments, payload, "\n".join(lines))
    return ExitCode.OK


def _schedule_change(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    with _open(arguments) as database:
        scheduler = Scheduler(database)
        action = arguments.schedule_command
        if action == "pause":
            record = scheduler.pause(arguments.name, arguments.note).to_dict()
        elif action == "unpause":
            record = scheduler.unpause(arguments.name, arguments.note).to_dict()
        elif action == "delete":
            record = scheduler.delete(arguments.name).to_dict()
        else:
            record = scheduler.trigger(arguments.name).to_dict()
    _emit(arguments, record, f"schedule {arguments.name}: {action} done"
          + (f" ({record['status']}, task {record['task_id']})" if action == "trigger" else ""))
    return ExitCode.OK


def _schedule_backfill(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    with _open(arguments) as database:
        result = Scheduler(database, max_backfill=arguments.max_fires).backfill(arguments.name, arguments.start,
                                                                                 arguments.end)
    _emit(arguments, result, f"backfill of {result['schedule']}: {result['fired']} fired, {result['buffered']} "
                             f"buffered, {result['skipped']} skipped, {result['already_fired']} fired before")
    return ExitCode.OK


def _schedule_run(arguments: argparse.Namespace) -> int:
    from ..control.schedules import Scheduler

    stop = _stop_on_signals()
    with _open(arguments) as database:
        scheduler = Scheduler(database, name=f"scheduler-{os.getpid()}")
        print(f"scheduler {scheduler.name} ticking every {arguments.interval:g} s", file=sys.stderr, flush=True)
        while not stop["stop"]:
            counts = scheduler.tick()
            if any(counts.values()):
                print(f"tick: {counts}", file=sys.stderr, flush=True)
            time.sleep(arguments.interval)
    return ExitCode.OK


def _stop_on_signals() -> dict[str, bool]:
    flag = {"stop": False}

    def stop(*_: Any) -> None:
        flag["stop"] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return flag


# -- task ------------------------------------------------------------------------------------
def _task_submit(arguments: argparse.Namespace) -> int:
    from ..control import TaskQueue

    payload = _checked_payload(arguments)
    with _open(arguments) as database:
        task, created = TaskQueue(database).submit(
            arguments.action, arguments.target, queue=arguments.queue, payload=payload, priority=arguments.priority,
            idempotency_key=arguments.idempotency_key, concurrency_key=arguments.concurrency_key,
            concurrency_limit=arguments.concurrency_limit, max_attempts=arguments.max_attempts)
    _emit(arguments, {**task.to_dict(), "created": created},
          f"task {task.task_id} {'queued' if created else 'exists already (same idempotency key)'} "
          f"on queue {task.queue}")
    return ExitCode.OK


def _task_list(arguments: argparse.Namespace) -> int:
    from ..control import TaskQueue

    with _open(arguments) as database:
        tasks = TaskQueue(database).list_tasks(queue=arguments.queue, state=arguments.state, limit=arguments.limit)
    lines = [f"{'TASK':<18} {'QUEUE':<12} {'KIND':<10} {'STATE':<10} {'TRY':<5} {'CREATED':<26} TARGET"]
    lines += [f"{task.task_id:<18} {task.queue:<12} {task.action_kind:<10} {task.state:<10} "
              f"{task.attempts}/{task.max_attempts:<3} {_iso(task.created_at):<26} {task.target[:40]}"
              for task in tasks]
    _emit(arguments, [task.to_dict() for task in tasks], "\n".join(lines))
    return ExitCode.OK


def _task_show(arguments: argparse.Namespace) -> int:
    from ..control import TaskQueue

    with _open(arguments) as database:
        queue = TaskQueue(database)
        task = queue.get(arguments.task_id)
        payload = {**task.to_dict(), "waiting_because": queue.why_waiting(task), "events": queue.events(task.task_id)}
    lines = [f"{key}: {value}" for key, value in task.to_dict().items()]
    if payload["waiting_because"]:
        lines.append(f"waiting because: {payload['waiting_because']}")
    lines += [f"{_iso(event['at'])} {event['from_state'] or '-'} -> {event['to_state']} ({event['kind']}"
              f"{', ' + event['worker'] if event['worker'] else ''}) {event['detail'] or ''}"
              for event in payload["events"]]
    _emit(arguments, payload, "\n".join(lines))
    return ExitCode.OK


def _task_change(arguments: argparse.Namespace) -> int:
    from ..control import TaskQueue

    with _open(arguments) as database:
        queue = TaskQueue(database)
        if arguments.task_command == "cancel":
            task = queue.cancel(arguments.task_id, reason=arguments.reason or "cancelled by an operator",
                                terminate=arguments.terminate)
        else:
            task = queue.retry(arguments.task_id)
    _emit(arguments, task.to_dict(), f"task {task.task_id} {task.state}"
          + (" (its worker was asked to stop)" if task.cancel_requested and task.state != "cancelled" else ""))
    return ExitCode.OK


# -- worker ----------------------------------------------------------------------------------
def _worker(arguments: argparse.Namespace) -> int:
    from ..control import ACTION_KINDS, ControlDatabase
    from ..control.outbox import deliver_task_transitions
    from ..control.schedules import Scheduler
    from ..control.worker import Worker
    from ..lanes import open_store

    kinds = arguments.action or list(ACTION_KINDS)
    unknown = [kind for kind in kinds if kind not in ACTION_KINDS]
    if unknown:
        print(f"opgraph worker: unknown action kind(s) {', '.join(unknown)}; known: {', '.join(ACTION_KINDS)}",
              file=sys.stderr)
        return ExitCode.USAGE

    def session() -> Any:
        from ..connection import open_session

        return open_session(arguments.address, namespace=arguments.namespace, default_model=arguments.default_model)

    async def main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, stop.set)
        with open_store(arguments.store) as store:  # first: the store's tables (its outbox) exist from here
            database = deliver_task_transitions(ControlDatabase(arguments.store))
            ticker = None
            if arguments.schedules:
                ticker = asyncio.create_task(_tick_schedules(Scheduler(ControlDatabase(arguments.store),
                                                                       name=f"worker-{os.getpid()}"), stop))
            worker = Worker(database, queue=arguments.queue, concurrency=arguments.concurrency,
                            lease_seconds=arguments.lease, grace=arguments.grace, action_kinds=kinds,
                            store=store, session_factory=session)
            print(f"worker {worker.worker_id} on queue {arguments.queue} (concurrency {arguments.concurrency}, "
                  f"lease {arguments.lease:g} s, kinds {', '.join(kinds)})", file=sys.stderr, flush=True)
            try:
                return await worker.run(stop, max_tasks=arguments.max_tasks, until_idle=arguments.until_idle)
            finally:
                stop.set()
                if ticker is not None:
                    await asyncio.gather(ticker, return_exceptions=True)
                database.close()

    from .spine import leaving_ray_as_found

    with leaving_ray_as_found():
        counts = asyncio.run(main())
    print(json.dumps(counts), flush=True)
    return ExitCode.OK


async def _tick_schedules(scheduler: Any, stop: asyncio.Event) -> None:
    from ..control import ControlError

    try:
        while not stop.is_set():
            try:
                await asyncio.to_thread(scheduler.tick)
            except ControlError as exc:  # the database is away: the next tick tries again
                print(f"scheduler: {exc}", file=sys.stderr, flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                continue
    finally:
        scheduler.db.close()


# -- parsers ---------------------------------------------------------------------------------
def _task_options(parser: argparse.ArgumentParser) -> None:
    from ..control import ACTION_KINDS

    parser.add_argument("--action", required=True, choices=ACTION_KINDS, help="the task's action_kind")
    parser.add_argument("--target", required=True,
                        help="workflow NAME[@VERSION] or FILE.json, a prompt (agent, flow), a playbook name (play), "
                             "a flow spec file (flow_yaml), a node count is given as payload (fanout)")
    parser.add_argument("--payload", default=None, metavar="JSON", help="the task's payload, a JSON object")
    parser.add_argument("--input", action="append", metavar="KEY=VALUE", help="a workflow input (repeatable)")
    parser.add_argument("--model", default=None, help="provider/model for the run's model nodes")
    parser.add_argument("--queue", default="default", help="the queue (default)")
    parser.add_argument("--priority", type=int, default=0, help="higher runs first within the queue (0)")
    parser.add_argument("--max-attempts", type=positive_int, default=3, help="attempts before dead (3)")


def _on_one_task(tasks: Any, name: str, help_text: str, handler: Any) -> argparse.ArgumentParser:
    """``opgraph task NAME TASK_ID``: an action on one task, by its id."""
    action = subcommand(tasks, name, help_text, codes=CODES)
    action.add_argument("task_id", metavar="TASK_ID")
    add_options(action, STORE, JSON)
    action.set_defaults(handler=_guarded(handler))
    return action


def add_control_parsers(subcommands: Any) -> None:
    from ..control import OVERLAP_POLICIES, TASK_STATES

    schedules = command_group(subcommands, "schedule", "schedules that submit tasks on a cadence (cron or interval)")
    add = subcommand(schedules, "add", "add a schedule", codes=CODES,
                     notes="DST: a skipped wall time fires shifted forward by the gap; a repeated one fires once.")
    add.add_argument("name")
    _task_options(add)
    cadence = add.add_mutually_exclusive_group(required=True)
    cadence.add_argument("--cron", default=None, help="a cron expression, e.g. '*/5 * * * *'")
    cadence.add_argument("--every", type=float, default=None, metavar="SECONDS", help="a fixed interval")
    add.add_argument("--timezone", default="UTC", help="IANA time zone of the cron expression (UTC)")
    add.add_argument("--overlap", choices=OVERLAP_POLICIES, default="skip",
                     help="what a fire does while the schedule's previous task is active (skip)")
    add.add_argument("--catchup-window", type=float, default=60.0, metavar="SECONDS",
                     help="missed fires younger than this fire late; older ones are recorded skipped (60)")
    add.add_argument("--jitter", type=float, default=0.0, metavar="SECONDS", help="delay each fire by up to this")
    add.add_argument("--start", type=_when, default=None, help="no fire before this time (ISO 8601 or epoch)")
    add.add_argument("--end", type=_when, default=None, help="no fire after this time (ISO 8601 or epoch)")
    add.add_argument("--max-actions", type=positive_int, default=None, help="stop after this many fires")
    add.add_argument("--paused", action="store_true", help="add it paused")
    add.add_argument("--note", default=None, help="a note kept with the schedule")
    add_options(add, STORE, JSON)
    add.set_defaults(handler=_guarded(_schedule_add))
    listing = subcommand(schedules, "list", "list the schedules with their next fire", codes=CODES)
    add_options(listing, STORE, JSON)
    listing.set_defaults(handler=_guarded(_schedule_list))
    show = subcommand(schedules, "show", "a schedule, its next fire times and its recent fires", codes=CODES)
    show.add_argument("name")
    show.add_argument("--limit", type=positive_int, default=20, help="recent fires shown (20)")
    add_options(show, STORE, JSON)
    show.set_defaults(handler=_guarded(_schedule_show))
    for action, text in (("pause", "pause a schedule, with a note"), ("unpause", "unpause a schedule, with a note"),
                         ("trigger", "fire a schedule now, under its overlap policy"),
                         ("delete", "delete a schedule (its fires and tasks stay)")):
        command = subcommand(schedules, action, text, codes=CODES)
        command.add_argument("name")
        if action in ("pause", "unpause"):
            command.add_argument("--note", default=None, help="why")
        add_options(command, STORE, JSON)
        command.set_defaults(handler=_guarded(_schedule_change))
    backfill = subcommand(schedules, "backfill", "fire the schedule's times in a range, under its overlap policy",
                          codes=CODES, notes="A range with more fires than --max-fires is refused; nothing fires.")
    backfill.add_argument("name")
    backfill.add_argument("--start", type=_when, required=True, help="ISO 8601 time or epoch seconds")
    backfill.add_argument("--end", type=_when, required=True, help="ISO 8601 time or epoch seconds")
    backfill.add_argument("--max-fires", type=positive_int,
                          default=int(os.environ.get("OPGRAPH_BACKFILL_MAX", "1000")),
                          help="refuse a range holding more fires (OPGRAPH_BACKFILL_MAX, else 1000)")
    add_options(backfill, STORE, JSON)
    backfill.set_defaults(handler=_guarded(_schedule_backfill))
    run = subcommand(schedules, "run", "a scheduler process: fire what is due until SIGTERM", codes=CODES,
                     notes="Any number may run at once: a fire's key is unique in the database.")
    run.add_argument("--interval", type=float, default=1.0, help="seconds between ticks (1)")
    add_options(run, STORE)
    run.set_defaults(handler=_guarded(_schedule_run))

    tasks = command_group(subcommands, "task", "tasks in the leased queue")
    submit = subcommand(tasks, "submit", "queue a task", codes=CODES)
    _task_options(submit)
    submit.add_argument("--idempotency-key", default=None, help="a second submit with this key makes no task")
    submit.add_argument("--concurrency-key", default=None,
                        help="tasks sharing this key run at most --concurrency-limit at once")
    submit.add_argument("--concurrency-limit", type=positive_int, default=None, help="(1 with a key)")
    add_options(submit, STORE, JSON)
    submit.set_defaults(handler=_guarded(_task_submit))
    listing = subcommand(tasks, "list", "list tasks, newest first", codes=CODES)
    listing.add_argument("--queue", default=None)
    listing.add_argument("--state", default=None, choices=TASK_STATES)
    listing.add_argument("--limit", type=positive_int, default=50)
    add_options(listing, STORE, JSON)
    listing.set_defaults(handler=_guarded(_task_list))
    _on_one_task(tasks, "show", "a task, its transitions and why it waits", _task_show)
    cancel = subcommand(tasks, "cancel", "cancel a task (a running one's lease ends now)", codes=CODES)
    cancel.add_argument("task_id", metavar="TASK_ID")
    cancel.add_argument("--reason", default=None)
    cancel.add_argument("--terminate", action=argparse.BooleanOptionalAction, default=True,
                        help="end a running task's lease now (default), or ask its worker to stop it")
    add_options(cancel, STORE, JSON)
    cancel.set_defaults(handler=_guarded(_task_change))
    _on_one_task(tasks, "retry", "queue a failed, dead or cancelled task again", _task_change)

    worker = subcommand(subcommands, "worker", "claim tasks of a queue and run them through their action adapters",
                        codes=(ExitCode.OK, ExitCode.USAGE, ExitCode.RUNTIME),
                        description="Claim tasks of one queue under leases and route each by its action_kind. "
                                    "SIGTERM stops claiming, lets running tasks finish within --grace, then gives "
                                    "their leases back. A worker also fires due schedules (--no-schedules: not).")
    worker.add_argument("--queue", default="default", help="the queue to claim from (default)")
    worker.add_argument("--concurrency", type=positive_int, default=1, help="tasks run at once (1)")
    worker.add_argument("--lease", type=float, default=30.0, metavar="SECONDS", help="lease length (30)")
    worker.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                        help="how long SIGTERM waits for running tasks (30)")
    worker.add_argument("--action", action="append", default=None, metavar="KIND",
                        help="claim only this action_kind (repeatable; default: every kind)")
    worker.add_argument("--schedules", action=argparse.BooleanOptionalAction, default=True,
                        help="also fire due schedules (default: yes)")
    worker.add_argument("--max-tasks", type=positive_int, default=None, help="stop after this many tasks")
    worker.add_argument("--until-idle", action="store_true", help="stop once the queue is empty")
    add_options(worker, STORE, RAY_ADDRESS, NAMESPACE, DEFAULT_MODEL)
    worker.set_defaults(handler=_worker)
