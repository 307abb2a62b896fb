"""BranchTable without Ray: copy-on-write clones, primary inheritance, and its errors.

The table is the BranchStore actor's whole state, so its semantics are pinned here,
fast and in-process; the actor tests check the same behaviour across processes.
"""

from __future__ import annotations

import pickle

import pytest

from opgraph.actors import BranchTable, UnknownBranchError
from opgraph.kernel import ExecutionError, OpGraphError


def table_with(branch_id: str = "root", messages: tuple = ("m1", "m2")) -> BranchTable:
    table = BranchTable()
    table.create(branch_id, messages)
    return table


def test_create_holds_the_messages_and_refuses_a_second_create():
    table = table_with()

    assert table.messages("root") == ["m1", "m2"]
    assert table.length("root") == 2
    assert "root" in table
    with pytest.raises(ExecutionError) as raised:
        table.create("root")
    assert raised.value.branch_id == "root"
    assert table.create("root", ["other"], exist_ok=True) is False
    assert table.messages("root") == ["m1", "m2"]


def test_a_clone_sees_the_source_then_diverges_both_ways():
    """root -> clone: appends on either side are invisible to the other."""
    table = table_with()
    table.clone("root", "clone")

    table.append("clone", ["c1"])
    table.append("root", ["r3"])

    assert table.messages("clone") == ["m1", "m2", "c1"]
    assert table.messages("root") == ["m1", "m2", "r3"]
    assert table.length("clone") == 3


def test_clones_of_clones_keep_their_frozen_prefixes():
    """root -> a -> b, with appends at every level after each clone."""
    table = table_with()
    table.clone("root", "a")
    table.append("a", ["a1"])
    table.clone("a", "b")
    table.append("a", ["a2"])
    table.append("root", ["r3"])
    table.append("b", ["b1"])

    assert table.messages("b") == ["m1", "m2", "a1", "b1"]
    assert table.messages("a") == ["m1", "m2", "a1", "a2"]
    assert table.messages("root") == ["m1", "m2", "r3"]


def test_a_clone_stores_only_its_own_new_messages():
    """Ten clones of a 1,000-message branch add no message copies."""
    table = table_with(messages=tuple(range(1000)))
    before = table.statistics()

    for index in range(10):
        table.clone("root", f"clone-{index}")
    table.append("clone-0", ["new"])

    after = table.statistics()
    assert after["branches"] == before["branches"] + 10
    assert after["own_messages"] == before["own_messages"] + 1
    assert after["clones"] == 10
    assert table.messages("clone-9") == list(range(1000))


def test_clone_onto_an_existing_branch_is_refused():
    table = table_with()
    table.create("taken")

    with pytest.raises(ExecutionError) as raised:
        table.clone("root", "taken")
    assert raised.value.branch_id == "taken"


def test_replace_history_adopts_the_source_without_touching_older_clones():
    """primary -> dependent (replace_history); a clone taken earlier keeps its view."""
    table = table_with("primary", ("p1", "p2"))
    table.create("dependent", ["d1"])
    table.clone("dependent", "snapshot")

    table.replace_history("dependent", "primary")
    table.append("dependent", ["d2"])
    table.append("primary", ["p3"])

    assert table.messages("dependent") == ["p1", "p2", "d2"]
    assert table.messages("snapshot") == ["d1"]
    assert table.messages("primary") == ["p1", "p2", "p3"]


def test_inheriting_from_a_lost_source_leaves_the_destination_and_says_so():
    """root <- replace_history(from missing): the source died with its store; root keeps its view."""
    table = table_with()
    before = table.messages("root")
    assert table.replace_history("root", "missing") is False
    assert table.messages("root") == before


def test_unknown_branches_raise_a_typed_error_naming_the_branch():
    table = table_with()

    for call in (
        lambda: table.messages("missing"),
        lambda: table.append("missing", ["x"]),
        lambda: table.clone("missing", "new"),
        lambda: table.replace_history("missing", "root"),
        lambda: table.length("missing"),
    ):
        with pytest.raises(UnknownBranchError) as raised:
            call()
        assert raised.value.branch_id == "missing"
    assert "new" not in table


def test_drop_forgets_the_branch_but_not_its_clones():
    table = table_with()
    table.clone("root", "clone")

    assert table.drop("root") is True
    assert table.drop("root") is False
    assert "root" not in table
    assert table.messages("clone") == ["m1", "m2"]


def test_unknown_branch_error_pickles_with_its_branch_id():
    """Ray ships it from the BranchStore to callers: the id must survive the trip."""
    error = UnknownBranchError("branch does not exist", branch_id="b-1")

    copy = pickle.loads(pickle.dumps(error))

    assert type(copy) is UnknownBranchError
    assert isinstance(copy, OpGraphError)
    assert copy.branch_id == "b-1"
    assert str(copy) == str(error)


# -- durable tables: a journal written and read back --------------------------------------------------
def test_a_journalled_table_reloads_exactly_what_it_held_and_forgets_what_nothing_sees(tmp_path):
    """root(m1, m2) -> clone c (+c1), then c takes root's history, root gains m3 and is dropped:
    reloaded, c still sees m1, m2; root is gone; c's first record, seen by nothing, left no rows."""
    from opgraph.actors.persistence import Database
    from opgraph.actors.persistence.branchlog import BranchJournal, load_shard

    database = Database(tmp_path / "branches.db")
    journal = BranchJournal(0)
    table = BranchTable(journal)
    table.create("root", ["m1", "m2"])
    table.clone("root", "c")
    table.append("c", ["c1"])
    table.replace_history("c", "root")
    table.append("root", ["m3"])
    table.drop("root")
    journal.write(database, journal.take())

    rows = load_shard(database, 0)
    reloaded = BranchTable.loaded(BranchJournal(0, rows.next_id), rows)
    assert reloaded.messages("c") == ["m1", "m2"]
    assert "root" not in reloaded
    assert [record_id for record_id, _, _ in rows.records] == [1, 3]  # record 2 (c's first) was forgotten
    reloaded.append("c", ["after reload"])
    reloaded.journal.write(database, reloaded.journal.take())
    assert BranchTable.loaded(BranchJournal(0), load_shard(database, 0)).messages("c") == ["m1", "m2", "after reload"]


def test_a_table_without_a_journal_keeps_nothing_and_costs_no_record_ids():
    table = table_with()
    table.clone("root", "copy")
    assert table.journal is None
    assert table.messages("copy") == ["m1", "m2"]


def test_two_owners_in_one_file_keep_their_own_record_ids_and_one_adopts_the_others_branch(tmp_path):
    """Runtimes A and B share a file, both from record id 1: each reloads only its own rows. B adopts
    A's clone (its whole history, through the parent record), and A, left with no branch, leaves no rows."""
    from opgraph.actors.persistence import Database
    from opgraph.actors.persistence.branchlog import BranchJournal, load_shard, read_branch, release_branch

    database = Database(tmp_path / "shared.db")
    tables = {}
    for owner, words in (("ns/a", ["a1", "a2"]), ("ns/b", ["b1"])):
        journal = BranchJournal(0, owner=owner)
        tables[owner] = table = BranchTable(journal)
        table.create("root-" + owner, words)
        table.clone("root-" + owner, "clone-" + owner)
        table.append("clone-" + owner, [words[0] + "!"])
        journal.write(database, journal.take())
    a_rows, b_rows = load_shard(database, 0, "ns/a"), load_shard(database, 0, "ns/b")
    assert [r[0] for r in a_rows.records] == [r[0] for r in b_rows.records] == [1, 2]
    assert set(a_rows.heads) == {"root-ns/a", "clone-ns/a"} and set(b_rows.heads) == {"root-ns/b", "clone-ns/b"}
    reloaded = BranchTable.loaded(BranchJournal(0, b_rows.next_id, "ns/b"), b_rows)
    assert reloaded.messages("clone-ns/b") == ["b1", "b1!"] and "clone-ns/a" not in reloaded

    assert read_branch(database, "clone-ns/a", besides="ns/b") == ("ns/a", ["a1", "a2", "a1!"])
    assert read_branch(database, "clone-ns/a", besides="ns/a") is None
    release_branch(database, "ns/a", "clone-ns/a")
    assert set(load_shard(database, 0, "ns/a").heads) == {"root-ns/a"}
    release_branch(database, "ns/a", "root-ns/a")
    gone = load_shard(database, 0, "ns/a")
    assert gone.records == [] and gone.messages == {} and gone.heads == {}
    assert load_shard(database, 0, "ns/b").heads == b_rows.heads


def test_a_version_1_file_keeps_its_branches_under_nobodys_owner(tmp_path):
    """A file written by the first runtime schema (rows keyed by shard only) opens migrated, once
    its rows are trusted (schema 4 signs them): its branches load under the owner "" and any
    runtime can adopt them."""
    import sqlite3

    import msgpack
    import pytest

    from opgraph.actors.persistence import Database
    from opgraph.actors.persistence.branchlog import load_shard, read_branch
    from opgraph.actors.persistence.database import RUNTIME_SCHEMA_VERSION, DatabaseError

    path = tmp_path / "v1.db"
    connection = sqlite3.connect(path)
    connection.executescript("""
        CREATE TABLE opgraph_runtime_schema (version INTEGER NOT NULL);
        INSERT INTO opgraph_runtime_schema VALUES (1);
        CREATE TABLE runtime_branch_records (shard INTEGER NOT NULL, record_id INTEGER NOT NULL,
            parent_id INTEGER, parent_len INTEGER NOT NULL, PRIMARY KEY (shard, record_id));
        CREATE TABLE runtime_branch_heads (branch_id TEXT PRIMARY KEY, shard INTEGER NOT NULL,
            record_id INTEGER NOT NULL);
        CREATE INDEX runtime_branch_heads_shard ON runtime_branch_heads (shard);
        CREATE TABLE runtime_branch_messages (shard INTEGER NOT NULL, record_id INTEGER NOT NULL,
            seq INTEGER NOT NULL, message BLOB NOT NULL, PRIMARY KEY (shard, record_id, seq));
        INSERT INTO runtime_branch_records VALUES (0, 1, NULL, 0);
        INSERT INTO runtime_branch_heads VALUES ('old', 0, 1);
    """)
    # A message as the first run-log codec wrote it: [schema 1, records].
    connection.execute("INSERT INTO runtime_branch_messages VALUES (0, 1, 0, ?)", (msgpack.packb([1, [["kept"]]]),))
    connection.commit()
    connection.close()

    with pytest.raises(DatabaseError, match="--trust-existing"):
        Database(path)
    database = Database(path, trust_existing=True)
    assert database.signed["messages"] == 1
    assert database.query("SELECT version FROM opgraph_runtime_schema") == [(RUNTIME_SCHEMA_VERSION,)]
    assert load_shard(database, 0, "").heads == {"old": 1}
    assert read_branch(database, "old", besides="ns/new") == ("", ["kept"])
    assert Database(path).query("SELECT count(*) FROM runtime_branch_heads") == [(1,)]  # opened twice: once migrated


def test_an_append_with_a_token_happens_once_however_often_it_is_sent():
    table = table_with()
    assert table.append("root", ["q", "a"], token=b"t1") == 4
    assert table.append("root", ["q", "a"], token=b"t1") == 4  # sent again: nothing appended
    assert table.append("root", ["q", "a"], token=b"t2") == 6  # another append, same words
    assert table.append("root", ["x"]) == 7 and table.append("root", ["x"]) == 8  # no token: every time
    table.clone("root", "copy")
    assert table.append("copy", ["q", "a"], token=b"t1") == 10  # a token counts for its own branch only
    assert table.messages("root") == ["m1", "m2", "q", "a", "q", "a", "x", "x"]


def test_histories_carry_shared_records_once_and_expand_to_every_branch_s_messages():
    """A run's clones are read for recording as the records they share (the planned lane's 500
    clones of one long branch): the parent's messages travel once, and each expands to its own."""
    from opgraph.actors.branches.store import expand_histories

    table = table_with()
    for index in range(3):
        table.clone("root", f"clone-{index}")
        table.append(f"clone-{index}", [f"own {index}"])
    table.append("root", ["later"])  # after the clones: none of them sees it
    table.clone("clone-0", "grandchild")
    table.append("grandchild", ["deeper"])
    wanted = ["clone-2", "missing", "grandchild", "root", "clone-0", "clone-1"]

    records, heads = table.histories(wanted)

    assert sum(len(own) for _, _, own in records) == 7  # m1, m2, later, three own, deeper: each once
    assert heads[1] is None
    assert expand_histories((records, heads)) == [
        None if branch_id == "missing" else table.messages(branch_id) for branch_id in wanted]
    assert table.messages("grandchild") == ["m1", "m2", "own 0", "deeper"]
