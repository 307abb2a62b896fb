"""The dataset jobs' tables on SQLite and PostgreSQL: a job found again, claimed once, each row recorded once.

    create_job -> claim_job -> record_rows (twice: the repeat is ignored) -> rows / totals in input order
"""

from __future__ import annotations

import os

import pytest

from opgraph.cluster.store import MapJobBusyError, MapJobNotFoundError, MapJobStore, RowOutcome
from opgraph.cluster.store.owners import ProcessIdentity

HASH = "sha256:" + "a" * 64


def outcome(key: str, ordinal: int, status: str = "done", **fields) -> RowOutcome:
    if status == "done":
        fields.setdefault("answer", {"label": key})
    else:
        fields.setdefault("error", f"{key} failed")
    return RowOutcome(key, ordinal, status, calls=1, prompt_tokens=3, completion_tokens=4, cost_usd=0.25,
                      model="sim/default", **fields)


def test_a_job_records_each_row_once_and_reads_them_back_in_input_order(database_target):
    with MapJobStore(database_target) as store:
        store.create_job("0123456789abcdef", command_key="k", input_ref="/data/in.jsonl", input_hash=HASH,
                         spec={"prompt": "{text}"})
        assert store.latest_job("k").job_id == "0123456789abcdef"
        assert store.get_job("0123").job_id == "0123456789abcdef"  # a unique prefix finds it
        with pytest.raises(MapJobNotFoundError):
            store.get_job("ffff")
        assert store.claim_job("0123456789abcdef").owner == store._owner

        written = store.record_rows("0123456789abcdef", [outcome("b", 1), outcome("a", 0), outcome("c", 2, "failed")])
        assert [row.row_key for row in written] == ["b", "a", "c"]
        again = store.record_rows("0123456789abcdef", [outcome("a", 0, answer="second"), outcome("d", 3)])
        assert [row.row_key for row in again] == ["d"]  # "a" keeps its first answer
        retried = store.record_rows("0123456789abcdef", [outcome("c", 2)], replace_failed=True)
        assert [row.row_key for row in retried] == ["c"]

        rows = list(store.rows("0123456789abcdef"))
        assert [row.row_key for row in rows] == ["a", "b", "c", "d"]
        assert rows[0].as_record()["answer"] == {"label": "a"}
        assert list(store.recorded_ordinals("0123456789abcdef", statuses=("done",))) == [0, 1, 2, 3]
        totals = store.totals("0123456789abcdef")
        assert (totals["done"], totals["failed"], totals["calls"]) == (4, 0, 5)  # c's two attempts both count
        assert totals["cost_usd"] == pytest.approx(1.25)


def test_a_job_run_by_a_live_process_is_not_claimed_by_another(database_target):
    with MapJobStore(database_target) as store:
        store.create_job("feedfacefeedface", command_key="k2", input_ref="in.csv", input_hash=HASH, spec={})
        store.claim_job("feedfacefeedface")
        parent = ProcessIdentity(store._owner.host, os.getppid(), None)  # alive: the test runner's parent
        store._owner = parent
        with pytest.raises(MapJobBusyError):
            store.claim_job("feedfacefeedface")
        store.update_job("feedfacefeedface", status="stopped")  # ended: its runner let it go
        assert store.claim_job("feedfacefeedface").owner_pid == parent.pid
