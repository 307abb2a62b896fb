"""`opgraph run result RUN_ID` and `opgraph run resume RUN_ID`: a run's end from any process, an orphan continued.

Owns the command-line face of detached and resumed runs: the envelope read from the run
log (``OPGRAPH_DB``) once the run ended, or awaited on the cluster while it is live; a lane
run's row settled and presented by its lane; an orphaned run continued from the log after
its lane's capabilities and pinned source allow it. Lanes are reached through the registry.

A run that ended other than completed, or one that is unknown, not resumable or refused by
its capabilities or changed source, is ``ExitCode.FAILED`` (``RESULT_CODES``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from opgraph.kernel import OpGraphError

from ..command_line import CLUSTER_ADDRESS, NAMESPACE, RAY_ADDRESS, STORE, ExitCode, add_options
from ..lanes import (
    LaneCapabilities,
    RunHooks,
    check_capabilities,
    lane_adapter,
    logged_end,
    open_store,
    resume_recorded,
    settle_recorded,
)
from ..store import RunNotFoundError, RunRecord, WorkflowStoreError, store_exists, store_location
from .spine import leaving_ray_as_found, refused, subcommand

__all__ = ["RESULT_CODES", "add_result_parsers", "run_result", "run_resume"]

RESULT_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME)


def _emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))


@contextlib.contextmanager
def _recorded(store_path: str | None, run_id: str) -> Iterator[tuple[Any, RunRecord | None]]:
    """The run store and the lane run it records under ``run_id`` (None: no lane ran it, or no store
    file), the store closed on leaving."""
    path = store_location(store_path)
    if not store_exists(path):
        yield None, None
        return
    with open_store(path) as store:
        try:
            record = store.get_run(run_id)  # reading settles an orphan: its owner's death is recorded
        except RunNotFoundError:
            record = None
        yield store, record


async def _awaited(run_id: str, address: str | None, namespace: str, timeout: float | None) -> dict[str, Any]:
    from opgraph.actors import RunControl

    from ..connection import probe_cluster

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    probe_cluster(address)
    control = await asyncio.to_thread(RunControl.attach, run_id, address=address, namespace=namespace)
    return await control.result(timeout)


def run_result(arguments: argparse.Namespace) -> int:
    """``opgraph run result RUN_ID``: the envelope (a lane run: its lane's result), from the log or the cluster."""
    try:
        with leaving_ray_as_found(), _recorded(arguments.store, arguments.run_id) as (store, record):
            ended = logged_end(arguments.run_id)
            if ended is not None and ended[1] is None:  # it failed as a whole: there is no envelope to present
                status, _, error = ended
                if record is not None and not record.terminal:
                    store.finish_run(record.run_id, "failed", error={"run": {"error": error, "type": status}})
                print(f"opgraph run result: run {arguments.run_id} ended {status}: {error}", file=sys.stderr)
                return ExitCode.FAILED
            if ended is not None:
                envelope = ended[1]
            else:  # live: only now is the cluster needed
                envelope = asyncio.run(_awaited(arguments.run_id, arguments.address, arguments.namespace,
                                                arguments.timeout))
            if record is None:
                from opgraph.actors import envelope_summary

                _emit(envelope if arguments.envelope else envelope_summary(envelope))
                return _ended(envelope["status"])
            adapter = lane_adapter(record.lane, store)
            result = settle_recorded(store, record, envelope, adapter.present)
            _emit({**result.to_dict(), **({"envelope": envelope} if arguments.envelope else {})})
            return _ended(result.status)
    except (OpGraphError, TimeoutError) as exc:  # unknown, failed as a whole, its lane unknown here; waited too long
        return refused("opgraph run result", exc)


def _ended(status: str) -> ExitCode:
    """A run read from another process: done when it completed, else failed (cancelled included)."""
    return ExitCode.OK if status == "completed" else ExitCode.FAILED


def _logged_live(run_id: str) -> bool:
    """Whether the run log keeps ``run_id`` as live: running somewhere, paused, or orphaned."""
    from opgraph.actors.persistence import RunLog, database_exists, database_path

    if not database_exists(database_path()):
        return False
    entry = RunLog(database_path()).entry(run_id)
    return entry is not None and entry.status == "live"


async def _resume_logged(arguments: argparse.Namespace, address: str | None) -> dict[str, Any]:
    """A run the log keeps as live but no lane recorded: resumed after a pause if an executor has
    it, else (its owner died) continued from the log on this command's runtime."""
    from opgraph.actors import RunControl, envelope_summary

    from ..connection import open_session, probe_cluster

    probe_cluster(address)
    control = await asyncio.to_thread(RunControl.attach, arguments.run_id, address=address,
                                      namespace=arguments.namespace)
    if control.executor is not None:
        return {"run_id": arguments.run_id, "action": "resume", "accepted": await control.resume(),
                "status": "resumed"}
    session = open_session(address, namespace=arguments.namespace)
    try:
        print(f"resuming {arguments.run_id} from the run log", file=sys.stderr)
        envelope = await RunControl.resume_from_log(arguments.run_id, session)
    finally:
        await session.aclose()
    return {**envelope_summary(envelope), "run_id": arguments.run_id, "status": envelope["status"]}


async def _resume_lane_run(arguments: argparse.Namespace, address: str | None, store: Any,
                           record: RunRecord) -> dict[str, Any]:
    """A lane run whose owner died: checked, then continued from the log on this command's runtime."""
    from ..connection import open_session

    adapter = lane_adapter(record.lane, store)
    # Refused before the runtime starts: a capability the run's invocation lacks, or a
    # source changed since the run pinned it.
    check_capabilities(LaneCapabilities.from_metadata(record.capabilities or {}), "checkpoint_resume",
                       lane=record.lane, run_id=record.run_id)
    adapter.check_replay(record)
    session = open_session(address, namespace=arguments.namespace)
    try:
        print(f"resuming {record.run_id} ({record.lane}, {record.source_ref}) from the run log", file=sys.stderr)
        result = await resume_recorded(adapter, record, session=session, store=store, hooks=RunHooks())
    finally:
        await session.aclose()
    return result.to_dict()


def run_resume(arguments: argparse.Namespace) -> int:
    """``opgraph run resume RUN_ID``: dispatch again after a pause, or continue a run whose owner died.

    A live run (an executor has it) is resumed after its pause, held against its lane's
    capabilities as every control is; a run whose owner died is continued from the run log:
    a lane run only where its capabilities include checkpoint resume and its pinned source
    is unchanged (``PinnedSourceChangedError`` otherwise), settled nodes never run again.
    """
    from .client import run_action

    try:
        with _recorded(arguments.store, arguments.run_id) as (store, record):
            if record is not None and record.terminal and not record.orphaned:
                print(f"opgraph run resume: run {record.run_id} ended {record.status}; there is nothing to resume",
                      file=sys.stderr)
                return ExitCode.FAILED
            live = (record is None and not _logged_live(arguments.run_id)) or (record is not None
                                                                               and not record.terminal)
            if not live:
                return _resume_from_log(arguments, store, record)
    except WorkflowStoreError as exc:
        return refused("opgraph run resume", exc)
    # A live run: the control "resume" after a pause (checked against a lane run's matrix there).
    return run_action("resume", arguments.run_id, address=arguments.address, namespace=arguments.namespace,
                      store=arguments.store)


def _resume_from_log(arguments: argparse.Namespace, store: Any, record: RunRecord | None) -> int:
    """A run whose owner died, continued from the run log on this command's runtime."""
    address = arguments.address or os.environ.get("RAY_ADDRESS") or None
    try:
        with leaving_ray_as_found():
            if record is None:
                payload = asyncio.run(_resume_logged(arguments, address))
            else:
                payload = asyncio.run(_resume_lane_run(arguments, address, store, record))
        _emit(payload)
        return _ended("completed" if payload["status"] == "resumed" else payload["status"])
    except OpGraphError as exc:  # refused by its capabilities or changed source; not in the log, not rebuilt
        return refused("opgraph run resume", exc)


def add_result_parsers(run_commands: Any) -> None:
    for action, help_text, handler in (
        ("result", "print how the run ended, from the run log (or wait for it on the cluster while it is live)",
         run_result),
        ("resume", "dispatch again after pause; or continue a run whose owner process died from the run log "
                   "(settled nodes do not run again)", run_resume),
    ):
        command = subcommand(run_commands, action, help_text, codes=RESULT_CODES,
                             notes="The run log is read from OPGRAPH_DB; --store holds the record of lane runs.")
        command.add_argument("run_id", metavar="RUN_ID")
        # A result is read from a cluster that runs it; a resumed orphan runs where this command starts or joins.
        add_options(command, CLUSTER_ADDRESS if action == "result" else RAY_ADDRESS, NAMESPACE, STORE)
        if action == "result":
            command.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                                 help="wait at most this long for a live run (default: until it ends)")
            command.add_argument("--envelope", action="store_true", help="print the whole result envelope too")
        command.set_defaults(handler=handler)
