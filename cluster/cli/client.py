"""A client against a running cluster: `opgraph run ...` on a run found by id, and `opgraph job submit`.

Owns the command-line face of ``RunControl.attach``: one JSON line per answer or event,
and exit statuses a shell can test. A control is first held against the capability
matrix the run recorded in the run store (ADR-0068 D3): one its invocation excludes is
rejected here and never reaches the cluster. `opgraph job submit` only assembles and runs
`ray job submit`; Ray's job server does the rest. Nothing here starts opgraph actors.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from ..command_line import ExitCode
from ..lanes import LaneCapabilities, LaneCapabilityError, check_capabilities
from ..processes import run_command
from ..store import RunNotFoundError, RunStore, WorkflowStoreError, store_exists, store_location
from .spine import leaving_ray_as_found, refused

__all__ = ["CONTROL_ACTIONS", "RUN_ACTIONS", "RUN_EXIT_CODES", "check_recorded_control", "run_action", "submit_job"]

RUN_ACTIONS = ("status", "pause", "resume", "cancel", "message", "watch")
# The control request kind (ADR-0068 D3) each action is; reading a run is no control.
CONTROL_ACTIONS = {"pause": "pause", "resume": "resume", "cancel": "cancel", "message": "message"}
RUN_EXIT_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME)  # what `opgraph run ACTION` returns


def submit_job(entrypoint: Sequence[str], *, address: str | None = None, working_dir: str = ".",
               no_wait: bool = False, submission_id: str | None = None, detach: bool = False,
               runtime_env: dict[str, Any] | None = None, ship: bool = True) -> int:
    """Run `ray job submit` and return its exit status (non-zero when the job FAILED)."""
    if not entrypoint:
        print("opgraph job submit: give the job's arguments after '--', e.g. "
              "opgraph job submit -- fanout --nodes 1000", file=sys.stderr)
        return ExitCode.USAGE
    # Here, not at the top: opgraph.cluster.jobs loads Ray and the engines, and every command's parser
    # reads RUN_EXIT_CODES from this module.
    from ..jobs.submission import job_submit_command

    command = job_submit_command(entrypoint, address=address, working_dir=working_dir, no_wait=no_wait,
                                 submission_id=submission_id, detach=detach, runtime_env=runtime_env, ship=ship)
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    try:
        # In the foreground, its output on this terminal: Ctrl-C reaches `ray job submit` as it would
        # if the user had typed it.
        return run_command(command, timeout=None, own_session=False, stdout=None, stderr=None).returncode
    except FileNotFoundError:
        print("opgraph job submit: the `ray` command is not on PATH (pip install 'ray[default]')",
              file=sys.stderr)
        return ExitCode.USAGE


def _event_line(item: Any, run_id: str) -> dict[str, Any]:
    from opgraph.actors import EventsDropped, Reconnected, RunFinished

    if isinstance(item, EventsDropped):
        return {"event": "dropped", "count": item.count}
    if isinstance(item, Reconnected):  # the executor was replaced; nodes settled meanwhile were not seen
        return {"event": "reconnected", "run_id": run_id, "executor": item.executor}
    if isinstance(item, RunFinished):
        return {"event": "finished", "status": item.status, "summary": item.summary}
    return {"event": "settled", "operation_id": item.operation_id, "name": item.name,
            "status": item.status, "spawned": item.spawned, "result": item.result}


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record, sort_keys=True, default=repr), flush=True)


async def _act(control: Any, action: str, text: str | None, limit: int | None) -> int:
    if action == "status":
        _emit(await control.status())
        return ExitCode.OK
    if action == "watch":
        seen = 0
        watch = control.watch()
        try:
            async for item in watch:
                record = _event_line(item, control.run_id)
                _emit(record)
                if record["event"] == "finished":
                    return ExitCode.OK if record["status"] == "completed" else ExitCode.FAILED
                if record["event"] == "settled":
                    seen += 1
                    if limit is not None and seen >= limit:
                        return ExitCode.OK
        finally:
            await watch.aclose()  # detaches the watcher when leaving early
        return ExitCode.OK
    if action == "message":
        accepted = await control.send_operator_message(text or "")
    else:
        accepted = await getattr(control, action)()
    _emit({"run_id": control.run_id, "action": action, "accepted": accepted})
    if not accepted:
        print(f"opgraph run {action}: run {control.run_id} has already settled", file=sys.stderr)
    return ExitCode.OK if accepted else ExitCode.FAILED


def check_recorded_control(run_id: str, action: str, store_path: str | None = None) -> None:
    """Raise ``LaneCapabilityError`` when the run store records ``run_id`` with a capability
    matrix that excludes ``action``. A run the store does not hold (a plain ``Session.flow``
    run, a fan-out job) has no lane matrix, and a store file that does not exist is not made."""
    request_kind = CONTROL_ACTIONS.get(action)
    path = store_location(store_path)
    if request_kind is None or not store_exists(path):
        return
    with RunStore(path) as store:  # reads only: no definition rules needed
        try:
            record = store.get_run(run_id)
        except RunNotFoundError:
            return
    capabilities = LaneCapabilities.from_metadata(record.capabilities or {})
    check_capabilities(capabilities, request_kind, lane=record.lane, run_id=run_id)


def run_action(action: str, run_id: str, *, address: str | None = None, namespace: str = "opgraph",
               text: str | None = None, limit: int | None = None, store: str | None = None) -> int:
    """`opgraph run ACTION RUN_ID`: attach to a run on a running cluster and act on it.

    A control the run's recorded capabilities exclude is refused first (``ExitCode.FAILED``), before
    Ray is reached: it is never queued anywhere.
    """
    if action not in RUN_ACTIONS:
        raise ValueError(f"unknown run action {action!r}; expected one of {RUN_ACTIONS}")
    try:
        check_recorded_control(run_id, action, store)
    except (LaneCapabilityError, WorkflowStoreError) as exc:  # refused, or a store that cannot be read
        return refused(f"opgraph run {action}", exc)

    from opgraph.actors import RunControl, UnknownRunError
    from opgraph.kernel import OpGraphError

    from ..connection import probe_cluster

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        with leaving_ray_as_found():
            # Ray would retry an address that does not answer for minutes (or forever), and
            # report a refused token as "cannot connect": ask the GCS first, for a few seconds.
            probe_cluster(address)
            control = RunControl.attach(run_id, address=address, namespace=namespace)
            return asyncio.run(_act(control, action, text, limit))
    except UnknownRunError:
        # The executor knows a run only while its owner waits on it.
        print(f"opgraph run {action}: run {run_id} is unknown or already finished (a run is found only "
              f"while the process that started it waits on it; namespace {namespace!r} at {address})",
              file=sys.stderr)
        return ExitCode.FAILED
    except OpGraphError as exc:  # the cluster could not be reached (RUNTIME), or it refused the control
        return refused(f"opgraph run {action}", exc)
    except ConnectionError as exc:
        print(f"opgraph run {action}: cannot reach a Ray cluster at {address!r}: {exc}", file=sys.stderr)
        return ExitCode.RUNTIME
