"""A self-contained kernel walk-through: plan -> (draft A, draft B) -> merge, driven by hand.

Owns nothing but a demonstration of ``FlowState.handle``: each dispatch is "completed"
instantly by this loop, which plays the part the GraphExecutor actor plays on Ray.
"""

from __future__ import annotations

from .builder import OperationGraphBuilder
from .events import DispatchOperation, EmitSignal, FinishRun, FlowStarted, OperationFinished
from .scheduler import FlowState

__all__ = ["main", "run_example"]


def run_example() -> dict:
    builder = OperationGraphBuilder("plan-draft-merge")
    plan = builder.add_operation("chat", node_id="plan", instruction="Plan a short essay.")
    drafts = [
        builder.add_operation("chat", node_id=f"draft-{name}", depends_on=[plan], inherit_context=True,
                              instruction=f"Write draft {name}.")
        for name in ("a", "b")
    ]
    builder.add_aggregation("chat", node_id="merge", source_node_ids=drafts, instruction="Merge the drafts.")
    state = FlowState(builder.get_graph(), max_concurrent=2, run_id="example")
    instructions = state.handle(FlowStarted(now=0.0))
    clock = 0.0
    envelope: dict = {}
    while True:
        for instruction in instructions:
            if isinstance(instruction, EmitSignal):
                signal = instruction.signal
                print(f"  t={clock:3.0f}  {signal.kind:<9} {getattr(signal, 'name', '')}")
            if isinstance(instruction, FinishRun):
                envelope = instruction.envelope
        dispatched = [i for i in instructions if isinstance(i, DispatchOperation)]
        if not dispatched:
            break
        clock += 1.0
        instructions = state.handle(
            *(
                OperationFinished(now=clock, node_id=d.node_id, attempt=d.attempt,
                                  response={"text": f"done: {d.parameters['instruction']}"})
                for d in dispatched
            )
        )
    return envelope


def main() -> int:
    print("opgraph kernel example: plan -> (draft-a, draft-b) -> merge, capacity 2")
    envelope = run_example()
    print(f"status={envelope['status']} completed={len(envelope['completed_operations'])} "
          f"skipped={len(envelope['skipped_operations'])} failed={len(envelope['failed_operations'])}")
    return 0 if envelope.get("status") == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
