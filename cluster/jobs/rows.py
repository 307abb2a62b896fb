"""A dataset job's input: rows streamed from JSONL, CSV or Parquet, the prompt template, the checks.

Owns reading an input through pyarrow's file systems (a path, or a URL pyarrow can open:
``file://``, and object stores when configured), a batch at a time and never whole; its
content hash; the ``{column}`` template; and the check every row passes before anything is
sent (a line that is not JSON, a row without its id, an id seen twice, a field the template
needs and the row lacks), which names the line or column of each problem. It calls no model.
"""

from __future__ import annotations

import hashlib
import json
import string
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from opgraph.kernel import OpGraphError

__all__ = [
    "BAD_ROW_POLICIES",
    "INPUT_FORMATS",
    "InputCheck",
    "InputRow",
    "MapInputChangedError",
    "MapInputError",
    "PromptTemplate",
    "RowSource",
    "check_input",
    "row_key",
]

# The file name endings an input is read by; anything else is refused before it is read.
INPUT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "csv",
                 ".parquet": "parquet", ".pq": "parquet"}
BAD_ROW_POLICIES = ("fail", "skip")
BATCH_ROWS = 4096  # rows one CSV or Parquet batch holds
READ_BYTES = 1 << 20  # bytes one read of a JSONL input (or of its hash) takes
PROBLEMS_KEPT = 20  # problems a check lists (it counts them all)


class MapInputError(OpGraphError):
    """A dataset job's input, template, schema or output cannot be used; nothing was sent.

    ``line`` is where the problem is (a JSONL line; a CSV or Parquet data row, counted from
    1), ``column`` the column or field concerned, ``location`` the input, when known.
    """

    def __init__(self, message: str, *, line: int | None = None, column: str | None = None,
                 location: str | None = None) -> None:
        super().__init__(message)
        self.line, self.column, self.location = line, column, location


class MapInputChangedError(MapInputError):
    """The input's content changed since its job ran (its hash differs): the recorded answers belong to
    the old content. Restore the file, or start a new job for the new content (``--new-job``)."""


class InputRow(NamedTuple):
    """One row as read: its place in the input (``ordinal``, from 0, every row counted), the line
    (JSONL) or data row (CSV, Parquet) it came from, its values, or why it cannot be read. A named
    tuple: a job makes one per row, and a frozen dataclass cost several times as much to make."""

    ordinal: int
    line: int
    values: Mapping[str, Any] | None
    problem: str | None = None


def row_key(value: Any) -> str | None:
    """A row's id as the job keys it: a string or a number as text; None for a missing or empty id."""
    if value is None or isinstance(value, (dict, list)):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


class PromptTemplate:
    """A prompt with ``{column}`` placeholders, filled from a row (``{{`` and ``}}`` are braces).

    A placeholder is a column name: no attribute, index or format spec, so a template can never
    reach into a value. ``fields`` are the names, in order of first use."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise MapInputError("the prompt template is empty")
        self.text = text
        parts: list[tuple[str, str | None]] = []
        try:
            for literal, name, spec, conversion in string.Formatter().parse(text):
                if name is not None and (spec or conversion or not name.strip() or any(c in name for c in ".[]")):
                    raise MapInputError(f"the template placeholder {{{name}{'!' + conversion if conversion else ''}"
                                        f"{':' + spec if spec else ''}}} is not a plain column name; write "
                                        "{column}, and {{ or }} for a brace", column=name)
                parts.append((literal, name))
        except ValueError as exc:  # an unmatched brace
            raise MapInputError(f"the prompt template cannot be read: {exc} (write {{{{ or }}}} for a brace)") from None
        self.parts = parts
        self.fields = list(dict.fromkeys(name for _, name in parts if name is not None))

    def render(self, values: Mapping[str, Any]) -> str:
        """The prompt for one row; a value is its text (a mapping or list as JSON, null as empty)."""
        out = []
        for literal, name in self.parts:
            out.append(literal)
            if name is not None:
                out.append(_text(values.get(name)))
        return "".join(out)

    def missing(self, values: Mapping[str, Any]) -> list[str]:
        return [name for name in self.fields if name not in values]


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


class RowSource:
    """An input file (a path, or a URL pyarrow's file systems open), read a batch at a time."""

    def __init__(self, location: str, input_format: str | None = None) -> None:
        self.location = str(location)
        self.format = input_format or INPUT_FORMATS.get(_suffix(self.location))
        if self.format not in ("jsonl", "csv", "parquet"):
            known = ", ".join(sorted(INPUT_FORMATS))
            raise MapInputError(f"cannot tell how to read {self.location}: the input is read by its name's ending "
                                f"({known})", location=self.location)
        self._filesystem, self._path = _open_location(self.location)
        self.delimiter = "\t" if _suffix(self.location) == ".tsv" else ","

    @property
    def reference(self) -> str:
        """The input as a job names it: an absolute path, or the URL as given."""
        if "://" in self.location:
            return self.location
        return str(Path(self.location).expanduser().resolve())

    def where(self, line: int) -> str:
        return f"line {line}" if self.format == "jsonl" else f"row {line}"

    def content_hash(self) -> str:
        """``sha256:`` and the hex digest of the input's bytes, read a megabyte at a time."""
        digest = hashlib.sha256()
        with self._filesystem.open_input_stream(self._path) as stream:
            while True:
                chunk = stream.read(READ_BYTES)
                if not chunk:
                    break
                digest.update(chunk)
        return "sha256:" + digest.hexdigest()

    def columns(self) -> list[str] | None:
        """The columns every row has (CSV, Parquet: the schema's), or None (JSONL: each row its own)."""
        if self.format == "csv":
            return list(self._csv_reader(None).schema.names)
        if self.format == "parquet":
            return list(self._parquet().schema_arrow.names)
        return None

    def rows(self) -> Iterator[InputRow]:
        """Every row in order, a batch at a time; a JSONL line that is not a JSON object comes as a problem."""
        if self.format == "jsonl":
            yield from self._jsonl_rows()
            return
        batches = self._csv_batches() if self.format == "csv" else self._parquet().iter_batches(batch_size=BATCH_ROWS)
        ordinal = 0
        for batch in batches:
            for values in batch.to_pylist():
                yield InputRow(ordinal, ordinal + 1, values)
                ordinal += 1

    def _jsonl_rows(self) -> Iterator[InputRow]:
        ordinal, line = 0, 0
        for raw in _lines(self._filesystem, self._path):
            line += 1
            if not raw.strip():
                continue
            try:
                values = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                column = f", column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                yield InputRow(ordinal, line, None, f"line {line} is not JSON ({reason}{column})")
            else:
                if isinstance(values, dict):
                    yield InputRow(ordinal, line, values)
                else:
                    yield InputRow(ordinal, line, None,
                                   f"line {line} is JSON but not an object (a {type(values).__name__})")
            ordinal += 1

    def _csv_reader(self, names: list[str] | None) -> Any:
        import pyarrow as pa
        from pyarrow import csv

        # Every column as text: a CSV holds text, and "007" must reach the prompt as it was written.
        convert = csv.ConvertOptions(column_types=dict.fromkeys(names, pa.string())) if names else None
        return csv.open_csv(self._filesystem.open_input_stream(self._path),
                            read_options=csv.ReadOptions(block_size=READ_BYTES),
                            parse_options=csv.ParseOptions(delimiter=self.delimiter), convert_options=convert)

    def _csv_batches(self) -> Iterator[Any]:
        names = self.columns()
        try:
            yield from self._csv_reader(names)
        except Exception as exc:
            raise MapInputError(f"{self.location} cannot be read as CSV: {exc}", location=self.location) from exc

    def _parquet(self) -> Any:
        from pyarrow import parquet

        try:
            return parquet.ParquetFile(self._filesystem.open_input_file(self._path))
        except Exception as exc:
            raise MapInputError(f"{self.location} cannot be read as Parquet: {exc}", location=self.location) from exc


def _suffix(location: str) -> str:
    name = location.rsplit("/", 1)[-1].lower()
    return "." + name.rsplit(".", 1)[-1] if "." in name else ""


def _open_location(location: str) -> tuple[Any, str]:
    """(pyarrow file system, path) for a path or a URL; ``MapInputError`` if it cannot be read."""
    from pyarrow import fs

    try:
        if "://" in location:
            filesystem, path = fs.FileSystem.from_uri(location)
        else:
            filesystem, path = fs.LocalFileSystem(), str(Path(location).expanduser().resolve())
        info = filesystem.get_file_info(path)
    except Exception as exc:
        raise MapInputError(f"cannot open the input {location}: {exc}", location=location) from exc
    if info.type == fs.FileType.NotFound:
        raise MapInputError(f"the input {location} does not exist", location=location)
    if info.type != fs.FileType.File:
        raise MapInputError(f"the input {location} is not a file", location=location)
    return filesystem, path


def _lines(filesystem: Any, path: str) -> Iterator[bytes | str]:
    """The lines of a file, a megabyte read at a time (without their line ends): as text when
    the megabyte's whole lines are UTF-8 (decoded at once, not a line at a time by the JSON
    reader), else as bytes, so that the line that is not is named by the reader."""
    rest = b""
    with filesystem.open_input_stream(path) as stream:
        while True:
            chunk = stream.read(READ_BYTES)
            if not chunk:
                break
            data = rest + chunk
            end = data.rfind(b"\n") + 1
            rest = data[end:]
            yield from _split(data[:end])
    if rest:
        yield from _split(rest)


def _split(data: bytes) -> list[bytes] | list[str]:
    lines: list[bytes] | list[str]
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = data.split(b"\n")
    if lines and not lines[-1] and data.endswith(b"\n"):
        lines.pop()  # what follows the last line end is the next read's
    return lines


# -- the check ---------------------------------------------------------------------------------
@dataclass
class InputCheck:
    """What a pass over the whole input found: ``rows`` to run, ``skipped`` (the places of rows
    refused, with ``--on-bad-row skip``), the first ``problems`` and how many there were, and the
    prompts' total length when they were rendered (a dry run)."""

    rows: int = 0
    skipped: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0
    prompt_chars: int = 0
    largest_prompt: int = 0
    sample_prompts: list[str] = field(default_factory=list)

    def refuse(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < PROBLEMS_KEPT:
            self.problems.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "skipped": len(self.skipped), "problems": list(self.problems),
                "problem_count": self.problem_count}


def check_input(source: RowSource, *, id_column: str, needed: Iterable[str] = (), on_bad_row: str = "fail",
                limit: int | None = None, template: PromptTemplate | None = None,
                render: bool = False) -> InputCheck:
    """Read the whole input once and check every row; raise ``MapInputError`` for the first problem
    (``on_bad_row="fail"``) or count and skip the rows that have one (``"skip"``).

    A row needs a JSON object (JSONL), an id in ``id_column`` seen in no earlier row, and every
    field of ``needed`` and of the template. A column every row lacks (CSV, Parquet) is refused
    whatever the policy. ``limit`` stops after that many rows to run. ``render`` fills the
    template for every row and measures the prompts (a dry run). Ids are held as 8-byte digests
    while reading (8 MB for a million rows); a digest seen twice is confirmed on the exact id."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise MapInputError(f"--on-bad-row is {' or '.join(BAD_ROW_POLICIES)}, not {on_bad_row!r}")
    needed = list(dict.fromkeys([*(template.fields if template else ()), *needed]))
    columns = source.columns()
    if columns is not None:
        for name in [id_column, *needed]:
            if name not in columns:
                role = "id column" if name == id_column else "field"
                raise MapInputError(f"the {role} {name!r} is not a column of {source.location} (its columns: "
                                    f"{', '.join(columns)})", column=name, location=source.location)
    check = InputCheck()
    digests, taken, last = array("Q"), 0, -1
    for row in _checked_rows(source, id_column, needed, on_bad_row, check, limit):
        digests.append(_digest(row_key(row.values[id_column])))
        taken, last = taken + 1, row.ordinal
        if render and template is not None:
            prompt = template.render(row.values)
            check.prompt_chars += len(prompt)
            check.largest_prompt = max(check.largest_prompt, len(prompt))
            if len(check.sample_prompts) < 3:
                check.sample_prompts.append(prompt)
    repeated = _repeated_digests(digests)
    del digests
    if repeated:
        duplicates = _duplicates(source, id_column, repeated, set(check.skipped), last)
        for ordinal, line, key, first_line in duplicates:
            message = (f"{source.where(line)} repeats the id {key!r} of {source.where(first_line)} "
                       f"(column {id_column!r})")
            if on_bad_row == "fail":
                raise MapInputError(message, line=line, column=id_column, location=source.location)
            check.refuse(message)
            check.skipped.append(ordinal)
    check.rows = taken - (len(duplicates) if repeated else 0)
    check.skipped.sort()
    return check


def _checked_rows(source: RowSource, id_column: str, needed: list[str], on_bad_row: str, check: InputCheck,
                  limit: int | None) -> Iterator[InputRow]:
    """The rows that pass the per-row checks (before duplicates), up to ``limit``."""
    taken = 0
    for row in source.rows():
        if limit is not None and taken >= limit:
            return
        problem, column = row.problem, None
        if problem is None:
            if row_key(row.values.get(id_column)) is None:
                problem, column = (f"{source.where(row.line)} has no id in column {id_column!r}"
                                   if id_column not in row.values or row.values[id_column] in (None, "")
                                   else f"{source.where(row.line)} has an id that is not text or a number "
                                        f"(column {id_column!r})"), id_column
            else:
                missing = [name for name in needed if name not in row.values]
                if missing:
                    problem, column = (f"{source.where(row.line)} has no field {missing[0]!r}, which the template "
                                       "needs"), missing[0]
        if problem is not None:
            if on_bad_row == "fail":
                raise MapInputError(problem, line=row.line, column=column, location=source.location)
            check.refuse(problem)
            check.skipped.append(row.ordinal)
            continue
        taken += 1
        yield row


def _digest(key: str | None) -> int:
    return int.from_bytes(hashlib.blake2b((key or "").encode(), digest_size=8).digest(), "little")


def _repeated_digests(digests: array) -> set[int]:
    """The digests that occur more than once (a sort of the 8-byte values, not a set of a million ints)."""
    if len(digests) < 2:
        return set()
    import numpy

    ordered = numpy.sort(numpy.frombuffer(digests, dtype=numpy.uint64))
    same = ordered[1:] == ordered[:-1]
    return {int(value) for value in ordered[1:][same]}


def _duplicates(source: RowSource, id_column: str, repeated: set[int], skipped: set[int],
                last: int) -> list[tuple[int, int, str, int]]:
    """(ordinal, line, id, line of its first row) of every checked row (not ``skipped``, up to the
    place ``last``) whose id an earlier checked row has."""
    first_seen: dict[str, int] = {}
    found = []
    for row in source.rows():
        if row.ordinal > last:
            break
        if row.ordinal in skipped or row.values is None:
            continue
        key = row_key(row.values.get(id_column))
        if key is None or _digest(key) not in repeated:
            continue
        if key in first_seen:
            found.append((row.ordinal, row.line, key, first_seen[key]))
        else:
            first_seen[key] = row.line
    return found
