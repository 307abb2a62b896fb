"""Runs that outlive the process that started them, across real processes.

    submit: process A joins a head, submits a run and exits; process B asks for the result
    resume: process C runs a graph on its own embedded Ray and is SIGKILLed (with its Ray)
            mid-run; this process continues the run from the run log

Every process shares one run-log database (``OPGRAPH_DB``), as processes on one machine do.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from opgraph.actors import RunControl
from opgraph.actors.persistence import RunLog, database_path
from opgraph.cluster.bench.chaos_durable import OWNER_SCRIPT, SETTLED_PRINTER, marks_per_node
from opgraph.cluster.processes import run_command, run_until

DEADLINE = 180.0

SUBMITTER = r"""
import asyncio, sys
from opgraph.actors import Session
from opgraph.cluster.jobs import fanout_graph
session = Session(address=sys.argv[1])
run_id = asyncio.run(session.submit(fanout_graph(40, 0.1), max_concurrent=8, run_id=sys.argv[2]))
print("submitted", run_id, flush=True)
"""

RESULT_READER = r"""
import asyncio, json, sys
from opgraph.actors import RunControl
control = RunControl.attach(sys.argv[2], address=sys.argv[1])
envelope = asyncio.run(control.result(timeout=120))
print(json.dumps({"status": envelope["status"], "nodes": len(envelope["operation_statuses"]),
                  "completed": len(envelope["completed_operations"])}), flush=True)
"""


def test_a_submitted_run_goes_on_after_its_process_exits_and_another_reads_its_result(ray_head):
    run_id = "detached-run-1"
    environment = {**ray_head.env(), "OPGRAPH_DB": os.environ["OPGRAPH_DB"]}
    submitted = run_command([sys.executable, "-c", SUBMITTER, ray_head.address, run_id], env=environment,
                            timeout=DEADLINE)
    assert submitted.returncode == 0, submitted.stderr
    assert f"submitted {run_id}" in submitted.stdout
    read = run_command([sys.executable, "-c", RESULT_READER, ray_head.address, run_id], env=environment,
                       timeout=DEADLINE)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout.strip().splitlines()[-1]) == {"status": "completed", "nodes": 40, "completed": 40}
    entry = RunLog(database_path()).entry(run_id)
    assert entry is not None and entry.status == "completed"


def test_a_run_whose_owner_was_killed_is_finished_from_the_log_without_rerunning_settled_nodes(session, tmp_path):
    """C runs 300 nodes (10 at a time) on its own embedded Ray and is SIGKILLed, Ray and all, after
    100 settled. Resumed here from the log: it completes; no node the log shows settled runs again."""
    marks = tmp_path / "marks.txt"
    # The owner and the Ray it started, every process of it, are killed once it printed "settled 100".
    run_until([sys.executable, "-c", OWNER_SCRIPT, str(marks), "owned-run-1", "300", "0.05", "10"],
              lambda lines: "settled 100" in lines, timeout=DEADLINE)
    log = RunLog(database_path())
    logged = log.load("owned-run-1")
    assert logged is not None and logged.entry.status == "live"
    settled = {record[2] for batch in logged.batches for record in batch
               if record[0] == "finished" and record[4] == "completed"}
    assert len(settled) >= 100
    before = marks_per_node(marks)

    envelope = asyncio.run(asyncio.wait_for(RunControl.resume_from_log("owned-run-1", session), DEADLINE))

    assert envelope["status"] == "completed" and len(envelope["completed_operations"]) == 300
    after = marks_per_node(marks)
    assert all(after[node] == before[node] == 1 for node in settled), "a node settled before the kill ran again"
    assert set(after) == set(envelope["operation_statuses"])
    assert log.entry("owned-run-1").status == "completed"


OWNER_OF_BRANCHES = r"""
import asyncio, sys
from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder

async def opening(branch, **parameters):
    await branch.append({"role": "user", "content": "ticket 7: refund"})
    return "opened"

async def reply(branch, instruction="", **parameters):
    await asyncio.sleep(0.1)
    seen = [message["content"] for message in await branch.messages()]
    await branch.append({"role": "assistant", "content": instruction})
    return seen

session = Session()
session.register_operation("opening", opening, record_turn=False)
session.register_operation("reply", reply, record_turn=False)
builder = OperationGraphBuilder("threads")
root = builder.add_operation("opening")
for index in range(40):
    builder.add_operation("reply", depends_on=[root], inherit_context=True, instruction=f"reply {index}")
""" + SETTLED_PRINTER + r"""
asyncio.run(session.flow(builder.get_graph(), max_concurrent=2, run_id="owned-run-2", isolated=True,
                         on_progress=progress))
"""


def test_a_resumed_run_adopts_the_dead_owners_branches_in_a_runtime_that_was_already_running(session):
    """C's isolated run (a root that writes the ticket, 40 replies cloned from it) is SIGKILLed after 11
    settled. This process's runtime, started long before, resumes it: every reply, before and after the
    kill, saw the ticket (the branches came over from C's rows); releasing the run drops all it made."""
    import ray

    def held() -> int:
        return ray.get(session.runtime.executor.statistics.remote())["branches"]["branches"]

    run_until([sys.executable, "-c", OWNER_OF_BRANCHES], lambda lines: "settled 11" in lines, timeout=DEADLINE)
    before = held()

    envelope = asyncio.run(asyncio.wait_for(RunControl.resume_from_log("owned-run-2", session), DEADLINE))

    assert envelope["status"] == "completed" and len(envelope["completed_operations"]) == 41
    replies = [result for result in envelope["operation_results"].values() if isinstance(result, list)]
    assert len(replies) == 40
    assert all(seen[:1] == ["ticket 7: refund"] for seen in replies), [seen for seen in replies if seen[:1] != [
        "ticket 7: refund"]]
    # A reply in flight at the kill (2 at a time) runs again on its primary's history, which
    # recover() has it take again: a first attempt's own append is replaced with it.
    assert sum(len(seen) > 1 for seen in replies) <= 2
    default = asyncio.run(session.messages(envelope["default_branch"]))
    assert [message["content"] for message in default] == ["ticket 7: refund"]
    assert held() > before
    asyncio.run(session.release_run("owned-run-2"))
    assert held() == before
