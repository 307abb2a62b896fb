"""The play lane's adapter (ADR-0068 D1, D2): a playbook resolved, its args typed, then the planned lane.

Owns turning ``opgraph play NAME [INPUT] --ARG VALUE ...`` into a planned invocation whose
source is the playbook (name, path and content hash in the provenance), with the
playbook's settings under the command line's, and the playbooks a surface may show
(``playbook``, ``catalogue``, ``check``), so no surface imports the playbook format. Planning,
running, controls and replay are the planned lane's (D1: a play is no fourth execution contract).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..base import REACTIVE_PLAY, LaneInvocation
from ..planned.adapter import PlannedFlowLane
from .playbook import Playbook, PlaybookError, list_playbooks, resolve_playbook

__all__ = ["PlayLane"]


class PlayLane(PlannedFlowLane):
    """The ``reactive_play`` adapter: a playbook's rendered prompt, planned and run as a planned flow."""

    lane: str = REACTIVE_PLAY

    def playbook(self, name: str, *, start: str | Path | None = None, home: str | Path | None = None) -> Playbook:
        """Playbook ``name``, resolved and checked (``PlaybookError``; ``UnknownPlaybookError`` names near ones)."""
        return resolve_playbook(name, start=start, home=home)

    def catalogue(self, *, start: str | Path | None = None, home: str | Path | None = None) -> list[dict[str, Any]]:
        """Every playbook the roots hold, as plain rows (name, path, description, content hash, args by name);
        one that does not load is a row with no name and its error."""
        rows: list[dict[str, Any]] = []
        for item in list_playbooks(start=start, home=home):
            if isinstance(item, PlaybookError):
                rows.append({"name": None, "path": item.path, "error": item.message})
            else:
                rows.append({"name": item.name, "path": str(item.path), "description": item.description,
                             "content_hash": item.content_hash,
                             "args": {arg.name: {"type": arg.type, "default": arg.default, "help": arg.help}
                                      for arg in item.args}})
        return rows

    def check(self, name: str, text: str, args: Mapping[str, Any], *, start: str | Path | None = None,
              home: str | Path | None = None) -> dict[str, Any]:
        """Playbook ``name`` resolved, its ``args`` converted and its prompt rendered with ``text``, without
        planning: a plain report (``PlaybookError`` when any of it fails)."""
        playbook = resolve_playbook(name, start=start, home=home)
        rendered = playbook.render(text, playbook.convert(dict(args)))
        return {"name": playbook.name, "path": str(playbook.path), "content_hash": playbook.content_hash,
                "ok": True, "settings": dict(playbook.settings), "prompt": rendered}

    def invocation(self, target: str, *, text: str = "", args: Mapping[str, Any] | None = None,
                   model: str | None = None, reactive: str | None = None, max_ops: int | None = None,
                   max_concurrent: int | None = None, run_id: str | None = None, durable: bool = True,
                   start: str | Path | None = None, home: str | Path | None = None, resume: bool = False,
                   retry_failed: bool = False, allow_degraded_context: bool = False,
                   **_: Any) -> LaneInvocation:
        """The invocation for playbook ``target`` with positional ``text`` and ``args`` (by arg name);
        an unknown name, a bad field or arg fails here, before any planning (``PlaybookError``)."""
        if resume:
            return super().invocation(target, resume=True, retry_failed=retry_failed,
                                      allow_degraded_context=allow_degraded_context, model=model,
                                      max_concurrent=max_concurrent, run_id=run_id, durable=durable)
        playbook = resolve_playbook(target, start=start, home=home)
        values = playbook.convert(dict(args or {}))
        task = playbook.render(text, values)
        settings = playbook.settings
        return self.planned_invocation(
            task, source_kind="playbook", source_ref=playbook.name, content_hash=playbook.content_hash,
            model=model or settings.get("model"), reactive=reactive or settings.get("reactive") or "all",
            max_ops=max_ops if max_ops is not None else int(settings.get("max_ops") or 0),
            roles=settings.get("roles"), max_assignments=settings.get("max_assignments"),
            synthesis=bool(settings.get("synthesis", True)),
            max_concurrent=max_concurrent or settings.get("workers") or 5, run_id=run_id, durable=durable,
            extra={"playbook": {"name": playbook.name, "path": str(playbook.path),
                                "content_hash": playbook.content_hash, "args": values, "input": text}})
