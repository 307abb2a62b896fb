"""The ``workflow`` job: a fixed workflow file run through the lane registry, recorded in the driver's store.

Owns what the job prints and returns for a lane run: the run id, progress lines, the
result's summary as the last stdout line and the whole result in a file on request. The
lane pins and compiles the file before Ray starts; the job never imports a lane's internals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

from opgraph.kernel import OpGraphError

from ..connection import RuntimeStartError
from ..lanes import FIXED_WORKFLOW, LaneRunResult, RunHooks, lane_adapter, open_store, parse_inputs
from ..store import WorkflowDefinitionError
from .driver import EXIT_RUN_NOT_COMPLETED, EXIT_USAGE, ProgressLog, detach_problem, job_address, job_detached

__all__ = ["run_workflow_job"]


async def _run_workflow(arguments: argparse.Namespace) -> LaneRunResult | str:
    """Run a workflow file on the fixed lane, recorded in the driver's SQLite store (``--detach``:
    admit it detached and return its id)."""
    import ray  # local: `--help` and usage errors must not pay for Ray

    from ..connection import open_session

    with open_store(arguments.store) as store:  # checked before Ray starts: a bad store is a usage error
        lane = lane_adapter(FIXED_WORKFLOW, store)
        # Under `ray job submit` the file is read from Ray's copy of the working dir; the run
        # records the path the user gave, which means something to them (and to the next job).
        invocation = lane.invocation(arguments.file, inputs=parse_inputs(arguments.input),
                                     base_dir=arguments.base_dir, model=arguments.model,
                                     run_id=arguments.run_id or f"workflow-{uuid.uuid4()}",
                                     max_concurrent=arguments.max_concurrent, source_ref=arguments.file)
        prepared = await lane.prepare(invocation)
        address = job_address(arguments)
        session = open_session(address, namespace=arguments.namespace, detached=job_detached(arguments, address))
        try:
            print(f"run_id: {prepared.run_id}", flush=True)
            if arguments.detach:
                return await lane.submit(prepared, session=session)
            print(f"starting {prepared.label} ({prepared.invocation.source_content_hash}) with "
                  f"{len(prepared.graph.nodes)} operations on {address or 'ray.init() default'}; "
                  f"store {store.path}", flush=True)
            progress = ProgressLog(len(prepared.graph.nodes), interval=arguments.progress_interval)
            result = await lane.execute(prepared, session=session, hooks=RunHooks(on_progress=progress))
            progress.close({"operation_statuses": result.statuses} if result.statuses else None)
            return result
        finally:
            ray.shutdown()


def run_workflow_job(arguments: argparse.Namespace) -> int:
    problem = detach_problem(arguments, job_address(arguments))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        result = asyncio.run(_run_workflow(arguments))
    except WorkflowDefinitionError as exc:
        print(json.dumps({"errors": exc.errors}), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RuntimeStartError:
        raise  # main() reports it
    except OpGraphError as exc:  # the store, the inputs: nothing ran
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if isinstance(result, str):  # admitted detached: the job ends, the run goes on
        print(json.dumps({"run_id": result, "status": "submitted", "lane": FIXED_WORKFLOW, "source": arguments.file},
                         sort_keys=True), flush=True)
        return 0
    payload: dict[str, Any] = result.to_dict()
    summary = {key: payload[key] for key in ("run_id", "status", "source", "content_hash", "statuses", "elapsed")}
    summary["failed"] = sorted(payload["errors"])
    if arguments.results:
        with open(arguments.results, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, default=repr)
        summary["results_file"] = os.path.abspath(arguments.results)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if result.status == "completed" else EXIT_RUN_NOT_COMPLETED
