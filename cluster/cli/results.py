"""`opgraph run result RUN_ID` and `opgraph run resume RUN_ID`: a run's end from any process, an orphan continued.

Owns the command-line face of detached and resumed runs: the envelope read from the run
log (``OPGRAPH_DB``) once the run ended, or awaited on the cluster while it is live; a lane
run's row settled and presented by its lane; an orphaned run continued from the log after
its lane's capabilities and pinned source allow it. Lanes are reached through the registry.

Exit codes: 0 completed; 1 failed, cancelled, unknown, not resumable or refused by the
run's capabilities or changed source (nothing ran); 2 bad arguments or store; 3 the runtime
could not be started or reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from opgraph.kernel import OpGraphError

from ..connection import EXIT_RUNTIME, RuntimeStartError
from ..lanes import (
    LaneCapabilities,
    LaneCapabilityError,
    PinnedSourceChangedError,
    RunHooks,
    UnknownLaneError,
    check_capabilities,
    lane_adapter,
    logged_end,
    open_store,
    resume_recorded,
    settle_recorded,
)
from ..store import RunNotFoundError, RunNotResumableError, RunRecord, WorkflowStoreError, store_exists, store_location

__all__ = ["EXIT_FAILED", "RESULT_EXIT_CODES", "add_result_parsers", "run_result", "run_resume"]

EXIT_FAILED, EXIT_INVALID = 1, 2
RESULT_EXIT_CODES = (f"exit status: 0 the run completed; {EXIT_FAILED} it failed or was cancelled, is unknown, or "
                     f"(resume) may not be resumed: nothing ran; {EXIT_INVALID} bad arguments or store; "
                     f"{EXIT_RUNTIME} the runtime could not be started or reached")


def _emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))


def _recorded(store_path: str | None, run_id: str) -> tuple[Any, RunRecord | None]:
    """The run store and the lane run it records under ``run_id`` (None: no lane ran it, or no store file)."""
    path = store_location(store_path)
    if not store_exists(path):
        return None, None
    store = open_store(path)
    try:
        return store, store.get_run(run_id)  # reading settles an orphan: its owner's death is recorded
    except RunNotFoundError:
        return store, None


async def _awaited(run_id: str, address: str | None, namespace: str, timeout: float | None) -> dict[str, Any]:
    from opgraph.actors import RunControl

    from ..connection import probe_cluster

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    probe_cluster(address)
    control = await asyncio.to_thread(RunControl.attach, run_id, address=address, namespace=namespace)
    return await control.result(timeout)


def run_result(arguments: argparse.Namespace) -> int:
    """``opgraph run result RUN_ID``: the envelope (a lane run: its lane's result), from the log or the cluster."""
    import ray  # local: only a live run needs the cluster

    joined_here = not ray.is_initialized()
    store = None
    try:
        store, record = _recorded(arguments.store, arguments.run_id)
        ended = logged_end(arguments.run_id)
        if ended is not None and ended[1] is None:  # it failed as a whole: there is no envelope to present
            status, _, error = ended
            if record is not None and not record.terminal:
                store.finish_run(record.run_id, "failed", error={"run": {"error": error, "type": status}})
            print(f"opgraph run result: run {arguments.run_id} ended {status}: {error}", file=sys.stderr)
            return EXIT_FAILED
        if ended is not None:
            envelope = ended[1]
        else:
            envelope = asyncio.run(_awaited(arguments.run_id, arguments.address, arguments.namespace,
                                            arguments.timeout))
        if record is None:
            from opgraph.actors import envelope_summary

            _emit(envelope if arguments.envelope else envelope_summary(envelope))
            return 0 if envelope["status"] == "completed" else EXIT_FAILED
        adapter = lane_adapter(record.lane, store)
        result = settle_recorded(store, record, envelope, adapter.present)
        _emit({**result.to_dict(), **({"envelope": envelope} if arguments.envelope else {})})
        return 0 if result.status == "completed" else EXIT_FAILED
    except RuntimeStartError as exc:
        print(f"opgraph run result: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except TimeoutError as exc:
        print(f"opgraph run result: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except WorkflowStoreError as exc:
        print(f"opgraph run result: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except OpGraphError as exc:  # unknown, failed as a whole, its lane unknown here
        print(f"opgraph run result: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if store is not None:
            store.close()
        if joined_here:
            ray.shutdown()


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

    store, record = None, None
    try:
        store, record = _recorded(arguments.store, arguments.run_id)
    except WorkflowStoreError as exc:
        print(f"opgraph run resume: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if record is not None and record.terminal and not record.orphaned:
        store.close()
        print(f"opgraph run resume: run {record.run_id} ended {record.status}; there is nothing to resume",
              file=sys.stderr)
        return EXIT_FAILED
    if (record is None and not _logged_live(arguments.run_id)) or (record is not None and not record.terminal):
        if store is not None:
            store.close()
        # A live run: the control "resume" after a pause (checked against a lane run's matrix there).
        return run_action("resume", arguments.run_id, address=arguments.address, namespace=arguments.namespace,
                          store=arguments.store)
    import ray  # local: the checks above come first, without Ray

    joined_here = not ray.is_initialized()
    address = arguments.address or os.environ.get("RAY_ADDRESS") or None
    try:
        if record is None:
            payload = asyncio.run(_resume_logged(arguments, address))
        else:
            payload = asyncio.run(_resume_lane_run(arguments, address, store, record))
        _emit(payload)
        return 0 if payload["status"] in ("completed", "resumed") else EXIT_FAILED
    except (LaneCapabilityError, PinnedSourceChangedError, RunNotResumableError, UnknownLaneError) as exc:
        print(f"opgraph run resume: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeStartError as exc:
        print(f"opgraph run resume: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except WorkflowStoreError as exc:
        print(f"opgraph run resume: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except OpGraphError as exc:  # not in the log, could not be rebuilt, its source unreadable
        print(f"opgraph run resume: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if store is not None:
            store.close()
        if joined_here:
            ray.shutdown()


def add_result_parsers(run_commands: Any) -> None:
    for action, help_text, handler in (
        ("result", "print how the run ended, from the run log (or wait for it on the cluster while it is live)",
         run_result),
        ("resume", "dispatch again after pause; or continue a run whose owner process died from the run log "
                   "(settled nodes do not run again)", run_resume),
    ):
        command = run_commands.add_parser(action, help=help_text, epilog=RESULT_EXIT_CODES[0].upper()
                                          + RESULT_EXIT_CODES[1:] + ".",
                                          description=help_text[0].upper() + help_text[1:] + ".")
        command.add_argument("run_id", metavar="RUN_ID")
        command.add_argument("--address", default=None,
                             help='Ray address ("auto", "ray://host:port", "host:port"; default: RAY_ADDRESS, else '
                                  + ("auto" if action == "result" else "an embedded local Ray") + ")")
        command.add_argument("--namespace", default="opgraph", help="Ray namespace of the runtime (opgraph)")
        command.add_argument("--store", default=None,
                             help="the run store of lane runs (default: OPGRAPH_DB or ~/.opgraph/opgraph.db); the "
                                  "run log is read from OPGRAPH_DB")
        if action == "result":
            command.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                                 help="wait at most this long for a live run (default: until it ends)")
            command.add_argument("--envelope", action="store_true", help="print the whole result envelope too")
        command.set_defaults(handler=handler)
