"""A dataset job's output file: JSON Lines exported from the run store, exactly one line per finished row.

Owns writing the file: rewritten whole from the store (to a temporary file, synced, then
renamed over the old one, so a crash leaves the old file or the new one, never half), and
appended to a window of newly recorded rows at a time, each append synced before the rows'
run may let them go. After any crash the next run of the job rewrites it from the store, so
a line half-written by the dead process never survives. It never decides what a row's answer is.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from opgraph.cluster.store import RowOutcome

from .rows import MapInputError

__all__ = ["OUTPUT_SUFFIXES", "OutputFile", "check_output", "read_records"]

OUTPUT_SUFFIXES = (".jsonl", ".ndjson", ".json")
WRITE_ROWS = 2000  # lines joined into one write while the file is rewritten


def check_output(location: str | os.PathLike[str]) -> Path:
    """The output path, refused (``MapInputError``) if its folder does not exist or it names no JSON Lines file."""
    path = Path(location).expanduser()
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise MapInputError(f"the output {location} must be a JSON Lines file ({', '.join(OUTPUT_SUFFIXES)}): one "
                            "line per row, exported from the run store")
    if not path.parent.resolve().is_dir():
        raise MapInputError(f"the output's folder {path.parent} does not exist; create it first")
    if path.is_dir():
        raise MapInputError(f"the output {location} is a folder")
    return path.resolve()


class OutputFile:
    """The JSON Lines export of one job's recorded rows at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0

    def rewrite(self, outcomes: Iterable[RowOutcome]) -> int:
        """Replace the file with one line per outcome, atomically; returns the lines written."""
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        count = 0
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                batch: list[str] = []
                for outcome in outcomes:
                    batch.append(outcome.as_line())
                    if len(batch) >= WRITE_ROWS:
                        handle.write("".join(batch))
                        count += len(batch)
                        batch.clear()
                handle.write("".join(batch))
                count += len(batch)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        finally:
            temporary.unlink(missing_ok=True)
        _sync_folder(self.path.parent)
        self.lines = count
        return count

    def append(self, outcomes: list[RowOutcome]) -> None:
        """Add one line per outcome and sync them to disk before returning."""
        if not outcomes:
            return
        data = "".join(outcome.as_line() for outcome in outcomes).encode("utf-8")
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(descriptor, view)
                view = view[written:]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        self.lines += len(outcomes)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a folder's entry is synced through the folder itself)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without folder handles: the rename is as durable as it gets there
    try:
        with contextlib.suppress(OSError):  # some file systems refuse a folder sync; the rename stays atomic
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of an output file (for tests and small files: it is read whole)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
