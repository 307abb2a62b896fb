"""`opgraph demo`: the main job on the embedded default — a plan, two parallel drafts, a merge.

Owns a small end-to-end run through the real runtime (local Ray, GraphExecutor,
BranchStore, OperationWorkers) with a built-in simulated writer, printing lifecycle
progress and the envelope summary. No model service is needed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["main", "simulated_writer"]


async def simulated_writer(branch: Any, instruction: str = "", context: dict | None = None,
                           latency: float = 0.2, **_: Any) -> dict[str, Any]:
    """A stand-in model: waits ``latency`` seconds and answers from the instruction and inputs."""
    await asyncio.sleep(latency)
    inputs = sorted(key for key in (context or {}) if key.endswith("_result"))
    history = len(await branch.messages())
    text = f"[sim] {instruction} (inputs: {len(inputs)}, history: {history} messages)"
    return {"text": text, "context": {"last_step": instruction}}


async def run_demo() -> dict[str, Any]:
    from opgraph.actors import Session
    from opgraph.kernel import OperationGraphBuilder

    started = time.perf_counter()
    session = Session()
    print(f"connected to Ray and started the runtime in {time.perf_counter() - started:.1f} s")
    session.register_operation("write", simulated_writer)
    builder = OperationGraphBuilder("plan-draft-merge")
    plan = builder.add_operation("write", node_id="plan", instruction="Plan a two-part essay on actors.")
    drafts = [
        builder.add_operation("write", node_id=f"draft-{part}", depends_on=[plan], inherit_context=True,
                              instruction=f"Draft part {part} following the plan.")
        for part in ("a", "b")
    ]
    builder.add_aggregation("write", node_id="merge", source_node_ids=drafts,
                            instruction="Merge the drafts into one essay.")

    def progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        print(f"  {elapsed:6.2f}s  {status:<9} {name}")

    run_started = time.perf_counter()
    envelope = await session.flow(builder.get_graph(), max_concurrent=2, on_progress=progress)
    print(f"run {envelope['run_id']} {envelope['status']} in {time.perf_counter() - run_started:.2f} s: "
          f"{len(envelope['completed_operations'])} settled, {len(envelope['failed_operations'])} failed, "
          f"{len(envelope['skipped_operations'])} skipped")
    merge_id = [n for n, s in envelope["operation_statuses"].items() if s == "completed"][-1]
    print("merge says:", envelope["operation_results"][merge_id]["text"])
    return envelope


def main(kernel_only: bool = False) -> int:
    if kernel_only:
        from opgraph.kernel.example import main as kernel_main

        return kernel_main()
    import ray

    try:
        envelope = asyncio.run(run_demo())
    finally:
        ray.shutdown()
    return 0 if envelope["status"] == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
