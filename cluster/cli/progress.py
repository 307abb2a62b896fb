"""Live progress of a command's run: a rich live view on a terminal, one plain line per event elsewhere.

Owns ``LiveDisplay`` (entering and leaving rich's live view, and the choice between it and
plain lines, so CI logs and pipes stay greppable) and ``ProgressDisplay``, the node table of
a lane run. An engine run's panel (``engine.EngineProgress``) is the other display built on it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LiveDisplay", "ProgressDisplay"]

_FINAL = {"completed": "done", "failed": "failed", "skipped": "skipped"}


class LiveDisplay:
    """A rich live view while in a ``with`` block on a terminal (``live=None``: when the console is
    one); ``refresh()`` redraws it from ``_render()``. Without it, a subclass prints plain lines."""

    def __init__(self, *, console: Any = None, live: bool | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.live_enabled = self.console.is_terminal if live is None else live
        self._live: Any = None

    def __enter__(self) -> Any:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=8, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc_info)
            self._live = None

    @property
    def showing_live(self) -> bool:
        return self._live is not None

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Any:
        raise NotImplementedError


class ProgressDisplay(LiveDisplay):
    """Counts of queued/running/done nodes and each node's last state: a table on a terminal, a line
    per lifecycle signal elsewhere."""

    def __init__(self, node_ids: list[str], *, console: Any = None, live: bool | None = None) -> None:
        super().__init__(console=console, live=live)
        self.states: dict[str, tuple[str, float]] = {node_id: ("waiting", 0.0) for node_id in node_ids}

    def counts(self) -> dict[str, int]:
        counts = {"queued": 0, "running": 0, "done": 0, "failed": 0, "skipped": 0}
        for state, _ in self.states.values():
            if state == "queued":
                counts["queued"] += 1
            elif state == "started":
                counts["running"] += 1
            elif state in _FINAL:
                counts[_FINAL[state]] += 1
        return counts

    def __call__(self, node_id: str, name: str, status: str, elapsed: float) -> None:
        self.states[node_id] = (status, elapsed)
        if self.showing_live:
            self.refresh()
        else:
            self.console.print(f"{elapsed:8.2f}s  {status:<9} {node_id}", highlight=False)

    def _render(self) -> Any:
        from rich.table import Table

        counts = self.counts()
        total = len(self.states)
        settled = counts["done"] + counts["failed"] + counts["skipped"]
        table = Table(title=f"{settled}/{total} settled · queued {counts['queued']} · running "
                            f"{counts['running']} · failed {counts['failed']} · skipped {counts['skipped']}",
                      title_justify="left")
        table.add_column("node")
        table.add_column("state")
        table.add_column("elapsed", justify="right")
        styles = {"completed": "green", "failed": "red", "skipped": "dim", "started": "yellow"}
        for node_id, (state, elapsed) in self.states.items():
            table.add_row(node_id, f"[{styles.get(state, '')}]{state}[/]" if state in styles else state,
                          f"{elapsed:.2f}s" if state != "waiting" else "")
        return table
