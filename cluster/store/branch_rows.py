"""How a run's branches are written in ``run_branches.messages``: a JSON list, or a prefix of another row and a tail.

Owns the column's two forms. A branch is its messages as a JSON list (every row written
before this form existed is one), or, when ``record_branches`` writes it beside a branch
of the same run whose first messages it shares, ``{"from": BRANCH, "take": N, "then": [...]}``:
the first ``N`` messages of that row, then its own. A planned run's 500 clones of its role's
branch, each that branch's first 100-300 messages and a turn of its own, were 15 MB of the
same JSON written at the run's end (a fifth of its time over its ideal); as prefixes they are
the messages once and 500 tails. Reading resolves every form back to the list it stands for.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["MIN_SHARED", "is_prefix_row", "prefix_rows", "resolve_rows"]

# A row shares at least this many messages with the one before it to be written as a prefix of it.
MIN_SHARED = 8


def is_prefix_row(value: Any) -> bool:
    """True for a decoded column that is the prefix form, not a list."""
    return isinstance(value, dict) and "from" in value


def _longest(a: list[Any], b: list[Any], same: Callable[[list[Any], list[Any]], bool]) -> int:
    """The longest ``n`` for which ``same(a[:n], b[:n])``, by bisection (``same`` holds for every
    shorter prefix of one it holds for)."""
    n = min(len(a), len(b))
    if same(a[:n], b[:n]):
        return n
    low, high = 0, n  # same for a[:low], not for a[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if same(a[low:middle], b[low:middle]):
            low = middle
        else:
            high = middle
    return low


def _identical(a: list[Any], b: list[Any]) -> bool:
    return all(map(operator.is_, a, b))


def _shared_length(a: list[Any], b: list[Any]) -> int:
    """How many first messages ``a`` and ``b`` hold as the same objects: the same object is the same
    JSON, where equal ones need not be (``1 == True``). Found by list equality first (in C, and at
    once for the same object), then checked for identity."""
    n = _longest(a, b, operator.eq)
    if _identical(a[:n], b[:n]):
        return n
    return _longest(a, b, _identical)


def prefix_rows(branches: Iterable[tuple[str, str | None, list[Any]]],
                encode: Callable[[Any], str]) -> list[tuple[str, str | None, str]]:
    """``(branch_id, node_id, column)`` for each branch, in order: a branch that shares at least
    ``MIN_SHARED`` first messages (the same objects) with the branch before it is written as
    the prefix form over that one; any other as its JSON list (``encode``)."""
    rows: list[tuple[str, str | None, str]] = []
    before: tuple[str, list[Any]] | None = None
    for branch_id, node_id, messages in branches:
        shared = _shared_length(messages, before[1]) if before is not None and before[0] != branch_id else 0
        if shared >= MIN_SHARED:
            column = (f'{{"from": {json.dumps(before[0])}, "take": {shared}, '
                      f'"then": {encode(messages[shared:])}}}')
        else:
            column = encode(messages)
        rows.append((branch_id, node_id, column))
        before = (branch_id, messages)
    return rows


def resolve_rows(rows: Mapping[str, Any], fail: Callable[[str, str], Exception]) -> dict[str, list[Any]]:
    """Each row's messages as a list, from its decoded column (``rows``: branch id -> list or prefix
    form). ``fail(branch_id, why)`` is raised for a prefix of a row that is not there, or a loop."""
    resolved: dict[str, list[Any]] = {}
    for start in rows:
        chain: list[str] = []
        branch_id = start
        while branch_id not in resolved:
            value = rows.get(branch_id)
            if value is None:
                raise fail(chain[-1] if chain else start, f"it continues branch {branch_id}, which is not recorded")
            if not is_prefix_row(value):
                resolved[branch_id] = list(value)
                break
            if branch_id in chain:
                raise fail(branch_id, "its recorded prefixes form a loop")
            chain.append(branch_id)
            branch_id = value["from"]
        for branch_id in reversed(chain):
            value = rows[branch_id]
            resolved[branch_id] = resolved[value["from"]][:int(value["take"])] + list(value["then"])
    return resolved
