"""A script that runs a flow and simply ends (no ray.shutdown()) leaves no noise behind."""

from __future__ import annotations

import os
import sys
import textwrap

from opgraph.cluster.processes import run_command


def test_a_script_ending_without_shutdown_prints_no_pending_task_report(tmp_path):
    script = textwrap.dedent("""
        from opgraph.actors import Session
        from opgraph.kernel import Graph, create_operation

        graph = Graph("two")
        for i in range(2):
            graph.add_node(create_operation("sleep", {"seconds": 0.0, "result": i}))
        envelope = Session().run(graph)
        print("status", envelope["status"])
    """)
    env = {**os.environ, "OPGRAPH_HOME": str(tmp_path)}
    done = run_command([sys.executable, "-c", script], timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "status completed" in done.stdout
    # The executor's loop-lag probe used to be a task; Ray ends the actor with the loop
    # running, and asyncio reported the pending task into the script's output.
    assert "Task was destroyed" not in done.stdout + done.stderr
