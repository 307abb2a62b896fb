"""One run on a simulated multi-node cluster: three raylets joined to one head, each with its own CPUs.

    head (2 CPUs, resource node-0)  +  node-1 (2 CPUs)  +  node-2 (2 CPUs)
        Session(address=cluster): 4 workers and 2 branch stores placed by Ray's default scheduling,
        and the default executor pool: one executor per alive node (3), each preferring its own node
        fan-out of 60 nodes x 20 ms: each node answers with the id of the Ray node it ran on

The cluster (``ray.cluster_utils.Cluster``, as Ray's own tests build them) runs in a
subprocess of its own, since this process already has its embedded Ray; the subprocess
prints what it saw as JSON and shuts its cluster down.
"""

from __future__ import annotations

import json
import os
import sys

from opgraph.cluster.processes import run_command

CLUSTER_DEADLINE = 240.0

SCRIPT = r"""
import asyncio, json, os
import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node-0": 1}})
for index in (1, 2):
    cluster.add_node(num_cpus=2, resources={f"node-{index}": 1})
cluster.wait_for_nodes()
try:
    from opgraph.actors import Session
    from opgraph.kernel import OperationGraphBuilder

    async def where(branch, **parameters):
        await asyncio.sleep(0.02)
        return ray.get_runtime_context().get_node_id()

    session = Session(address=cluster.address, namespace="opgraph-multinode", workers=4, branch_stores=2,
                      durable=False)
    session.register_operation("where", where, record_turn=False)
    builder = OperationGraphBuilder("spread")
    for _ in range(60):
        builder.add_operation("where", depends_on=[])
    envelope = asyncio.run(session.flow(builder.get_graph(), max_concurrent=60))
    placed = {}
    for actor in ray._private.state.actors().values():
        if actor["State"] == "ALIVE" and actor["Name"].startswith("opgraph-"):
            placed[actor["Name"]] = actor["Address"]["NodeID"]
    print(json.dumps({
        "nodes": sorted(node["NodeID"] for node in ray.nodes() if node["Alive"]),
        "status": envelope["status"],
        "ran_on": sorted(envelope["operation_results"].values()),
        "placed": placed,
        "executors": session.runtime.executor_names,
    }), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_one_run_executes_on_every_node_with_workers_and_stores_spread_across_them(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["OPGRAPH_DB"] = str(tmp_path / "multinode.db")
    finished = run_command([sys.executable, "-c", SCRIPT], env=env,
                           timeout=CLUSTER_DEADLINE, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-4000:]
    seen = json.loads(finished.stdout.strip().splitlines()[-1])
    nodes = set(seen["nodes"])
    assert len(nodes) == 3 and seen["status"] == "completed" and len(seen["ran_on"]) == 60
    assert len(set(seen["ran_on"])) >= 2, "the run's nodes all executed on one Ray node"
    assert set(seen["ran_on"]) <= nodes
    workers = {name: node for name, node in seen["placed"].items() if "-worker-" in name}
    stores = {name: node for name, node in seen["placed"].items() if "-branches-" in name}
    assert len(workers) == 4 and len(stores) == 2, seen["placed"]
    executors = {name: seen["placed"][name] for name in seen["executors"]}
    assert len(executors) == 3, seen  # the default pool: one executor per alive node
    assert len(set(executors.values())) >= 2, f"the executors were packed onto one node: {executors}"
    # Ray's default placement spreads the pool here, though not one actor per node in turn
    # (seen: the workers on two nodes, both stores on the third).
    assert len(set(workers.values())) >= 2, f"the workers were packed onto one node: {workers}"
    assert len(set(workers.values()) | set(stores.values())) >= 2, f"the pool is on one node: {seen['placed']}"


def test_a_run_completes_when_a_whole_node_holding_workers_dies_mid_run(tmp_path):
    """cluster/bench/node_loss.py with a small fan-out (400 x 50 ms at 80): the node holding most
    workers is removed (raylet and every process) 30% in; the run completes, every node once or more,
    and only attempts that were in flight can have run twice."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["OPGRAPH_DB"] = str(tmp_path / "node-loss.db")
    finished = run_command([sys.executable, "-m", "opgraph.cluster.bench.node_loss", "--nodes", "400",
                           "--seconds", "0.05", "--concurrency", "80"], env=env,
                           timeout=CLUSTER_DEADLINE, cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    seen = json.loads(finished.stdout[finished.stdout.index("{"):])
    assert (seen["status"], seen["nodes"], seen["completed"]) == ("completed", 400, 400)
    assert any("-worker-" in name for name in seen["actors_on_killed_node"]), seen
    assert seen["nodes_run_more_than_once"] <= 80  # at most what was in flight
