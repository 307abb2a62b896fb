"""The play lane (ADR-0068 D1): playbooks resolved and rendered, then planned and run as planned flows.

Owns the playbook format, resolution and checks (``playbook.py``), the bundled example
playbooks, and the adapter that turns a playbook into a planned invocation. ``LANE`` is the
entry the lane registry loads; surfaces reach the lane only through it.
"""

from ..planned.contract import planned_capabilities
from ..registry import LaneEntry
from .adapter import PlayLane
from .playbook import (
    ARG_TYPES,
    EXAMPLES_DIR,
    PLAYBOOK_FIELDS,
    SUFFIX,
    Playbook,
    PlaybookArg,
    PlaybookError,
    UnknownPlaybookError,
    list_playbooks,
    load_playbook,
    playbook_roots,
    resolve_playbook,
)

REACTIVE_PLAY = PlayLane.lane
EXAMPLES = {path.name[: -len(SUFFIX)]: path for path in sorted(EXAMPLES_DIR.glob(f"*{SUFFIX}"))}

LANE = LaneEntry(kind=REACTIVE_PLAY, factory=PlayLane, capabilities=planned_capabilities("all"), examples=EXAMPLES,
                 replays_ended_runs=True)

__all__ = [
    "ARG_TYPES",
    "EXAMPLES",
    "EXAMPLES_DIR",
    "LANE",
    "PLAYBOOK_FIELDS",
    "REACTIVE_PLAY",
    "SUFFIX",
    "Playbook",
    "PlaybookArg",
    "PlaybookError",
    "PlayLane",
    "UnknownPlaybookError",
    "list_playbooks",
    "load_playbook",
    "playbook_roots",
    "resolve_playbook",
]
