"""Two processes on one cluster: one process's exit never ends the other's run.

    process B: Session(address=head)  -> starts the namespace's runtime first, then exits
    process A: Session(address=head)  -> its 20 x 0.2 s run (at max_concurrent=2) goes on and completes

Both join through an address, so the runtime's actors are detached and shared by name:
nobody owns them, so B's exit takes none of them down. This pytest process never joins.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from opgraph.cluster.processes import read_line

DEADLINE = 120.0

PROCESS_B = r"""
import sys
from opgraph.actors import Session
session = Session(address=sys.argv[1])
print("ready", session.runtime.executor_name, session.runtime.detached, flush=True)
sys.stdin.readline()  # exit when told
"""

PROCESS_A = r"""
import asyncio, json, sys
from opgraph.actors import Session
from opgraph.cluster.jobs import fanout_graph
session = Session(address=sys.argv[1])
def progress(op_id, name, status, elapsed):
    if status == "started":
        print("started", flush=True)
envelope = asyncio.run(session.flow(fanout_graph(20, 0.2), max_concurrent=2, on_progress=progress))
print(json.dumps({"status": envelope["status"], "executor": session.runtime.executor_name}), flush=True)
"""


def test_one_process_exiting_never_ends_another_process_run(ray_head):
    b = subprocess.Popen([sys.executable, "-c", PROCESS_B, ray_head.address], env=ray_head.env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    a = None
    try:
        ready = read_line(b.stdout, DEADLINE).split()
        assert ready[0] == "ready" and ready[2] == "True", ready  # detached: joined through an address
        a = subprocess.Popen([sys.executable, "-c", PROCESS_A, ray_head.address], env=ray_head.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert read_line(a.stdout, DEADLINE).strip() == "started"
        _, b_errors = b.communicate(input="", timeout=DEADLINE)  # B leaves while A's run is under way
        assert b.returncode == 0, b_errors
        started_after = time.monotonic()
        out, err = a.communicate(timeout=DEADLINE)
        assert a.returncode == 0, err
        lines = [line for line in out.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1])
        assert result["status"] == "completed"
        assert result["executor"] == ready[1]  # the same, shared runtime
        assert time.monotonic() - started_after < DEADLINE
    finally:
        for process in (a, b):
            if process is not None:
                if process.poll() is None:
                    process.kill()
                process.communicate()  # closes its pipes
