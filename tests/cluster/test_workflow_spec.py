"""The version-1 definition rules of ADR-0073 D1: one test per rule, plus names and hashing.

Pure: no Ray is started. Each test breaks one rule of an otherwise valid definition,
``input -> draft -> check`` (with a conditional edge into ``check``), and expects exactly
the structured problem that rule produces.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from opgraph.cluster.lanes.fixed import (
    MAX_EDGES,
    MAX_NODES,
    WorkflowCompileError,
    WorkflowDefinitionError,
    WorkflowValidationError,
    content_hash,
    load_definition,
    validate_definition,
)
from opgraph.cluster.store import canonical_json, normalise_name, validate_name
from opgraph.kernel import OpGraphError


def valid() -> dict:
    """input -> draft -> check (check gated by ``result != None``)."""
    return {
        "version": 1,
        "nodes": [
            {"id": "input", "kind": "input", "pos": {"x": 0, "y": 0}},
            {
                "id": "draft",
                "kind": "chat",
                "pos": {"x": 200, "y": 0},
                "config": {"prompt": "Draft the answer", "model": "openai/gpt-4.1-mini"},
            },
            {"id": "check", "kind": "chat", "pos": {"x": 400.5, "y": -3}, "config": {"prompt": "Check it"}},
        ],
        "edges": [
            {"id": "e1", "from": "input", "to": "draft"},
            {"id": "e2", "from": "draft", "to": "check", "condition": "result != None", "label": "ok"},
        ],
        "inputs": ["topic"],
        "outputs": ["check"],
    }


def only_problem(data) -> dict:
    errors = validate_definition(data)
    assert len(errors) == 1, errors
    return errors[0]


DELETED = object()  # the field is removed rather than set


def broken(changes: dict[str, object]) -> dict:
    """``valid()`` with each dotted path (``nodes.2.kind``) set to its value, or removed (``DELETED``)."""
    data = valid()
    for path, value in changes.items():
        *parents, last = path.split(".")
        target = data
        for key in parents:
            target = target[int(key) if key.isdigit() else key]
        key = int(last) if last.isdigit() else last
        if value is DELETED:
            del target[key]
        else:
            target[key] = value
    return data


# One rule broken, one structured problem naming what breaks it: (changes, error, node_id, edge_id).
ONE_RULE_BROKEN = {
    "version 1 is required": ({"version": 2}, 'the definition must have "version": 1, got 2', None, None),
    "a node needs an id": ({"nodes.2.id": "", "edges.1": DELETED}, "nodes[2] needs a non-empty string id, got ''",
                           None, None),
    "a node kind is an admitted one": ({"nodes.2.kind": "shell"},
                                       "unknown node kind 'shell'; admitted kinds: input, chat, parse, fanout, engine",
                                       "check", None),
    "a node needs numeric pos.x and pos.y": ({"nodes.0.pos": {"x": "0", "y": 0}},
                                             "a node needs numeric pos.x and pos.y", "input", None),
    "a node config is an object": ({"nodes.2.config": ["Check it"]}, "a node's config must be an object", "check",
                                   None),
    "a chat node needs a prompt": ({"nodes.2.config": {"prompt": "   "}},
                                   "a chat node needs a non-empty string config.prompt", "check", None),
    "an edge needs an id": ({"edges.1.id": None}, "edges[1] needs a non-empty string id, got None", None, None),
    "edge ids are unique": ({"edges.1.id": "e1"}, "duplicate edge id 'e1' (edges[0] and edges[1])", None, "e1"),
    "an edge references existing nodes": ({"edges.1.to": "missing"}, "edge 'to' names the unknown node 'missing'",
                                          None, "e2"),
    "an edge needs from and to": ({"edges.1.from": DELETED}, "edge 'from' must be a node id, got None", None, "e2"),
    "a condition is a non-empty string": ({"edges.1.condition": ""},
                                          "an edge condition must be a non-empty string when given", None, "e2"),
}


@pytest.mark.parametrize("rule", ONE_RULE_BROKEN)
def test_a_broken_rule_is_one_problem_naming_what_breaks_it(rule):
    changes, error, node_id, edge_id = ONE_RULE_BROKEN[rule]
    assert only_problem(broken(changes)) == {"error": error, "node_id": node_id, "edge_id": edge_id}


# -- a valid definition --------------------------------------------------------------------
def test_the_adr_example_definition_is_valid():
    assert validate_definition(valid()) == []


def test_a_definition_without_a_spec_is_storable_but_cannot_run():
    assert validate_definition(None) == []
    with pytest.raises(WorkflowCompileError, match="no spec_json to run"):
        load_definition(None)


def test_an_empty_definition_with_no_nodes_is_valid():
    assert validate_definition({"version": 1, "nodes": [], "edges": []}) == []


def test_load_definition_returns_a_typed_model_that_does_not_alias_the_input():
    data = valid()
    spec = load_definition(data)
    assert [n.id for n in spec.nodes] == ["input", "draft", "check"]
    gated = spec.edges[1]
    assert (gated.source, gated.target, gated.condition) == ("draft", "check", "result != None")
    assert spec.inputs == ("topic",) and spec.outputs == ("check",)
    data["nodes"].clear()
    assert len(spec.data["nodes"]) == 3


# -- top-level rules ------------------------------------------------------------------------
def test_a_definition_that_is_not_an_object_is_rejected():
    assert only_problem([1, 2])["error"].startswith("a workflow definition must be a JSON object")


def test_a_boolean_version_is_not_version_1():
    data = valid()
    data["version"] = True
    assert "version" in only_problem(data)["error"]


def test_a_top_level_base_dir_is_rejected_because_the_run_owns_the_root():
    data = valid()
    data["base_dir"] = "/tmp"
    assert "base_dir" in only_problem(data)["error"]


def test_nodes_must_be_an_array():
    data = valid()
    data["nodes"] = {"input": {}}
    data["edges"] = []
    assert only_problem(data)["error"] == "'nodes' must be an array, got dict"


def test_edges_must_be_an_array():
    data = valid()
    data["edges"] = "e1"
    assert only_problem(data)["error"] == "'edges' must be an array, got str"


def test_more_than_200_nodes_are_rejected():
    data = {
        "version": 1,
        "nodes": [{"id": f"n{i}", "kind": "input", "pos": {"x": 0, "y": 0}} for i in range(MAX_NODES + 1)],
        "edges": [],
    }
    assert only_problem(data)["error"] == "a definition holds at most 200 nodes, got 201"
    data["nodes"].pop()
    assert validate_definition(data) == []


def test_more_than_400_edges_are_rejected():
    data = valid()
    data["edges"] = [{"id": f"e{i}", "from": "draft", "to": "check"} for i in range(MAX_EDGES + 1)]
    assert only_problem(data)["error"] == "a definition holds at most 400 edges, got 401"
    data["edges"].pop()
    assert validate_definition(data) == []


def test_inputs_and_outputs_must_be_arrays_of_strings():
    data = valid()
    data["inputs"] = ["topic", 3]
    data["outputs"] = "check"
    assert [e["error"] for e in validate_definition(data)] == [
        "'inputs' must be an array of strings",
        "'outputs' must be an array of strings",
    ]


def test_a_non_json_value_is_rejected_because_it_cannot_be_hashed():
    data = valid()
    data["nodes"][1]["config"]["temperature"] = float("nan")
    data["extra"] = {1, 2}
    assert [e["error"] for e in validate_definition(data)] == [
        "definition.nodes[1].config.temperature is nan; JSON numbers must be finite",
        "definition.extra is a set, which is not a JSON value",
    ]


# -- node rules ------------------------------------------------------------------------------
def test_a_node_that_is_not_an_object_is_rejected():
    data = valid()
    data["nodes"].append("draft")
    assert only_problem(data)["error"] == "nodes[3] must be an object, got str"


def test_node_ids_must_be_unique():
    data = valid()
    data["nodes"][2]["id"] = "draft"
    data["edges"].pop()
    problem = only_problem(data)
    assert problem["node_id"] == "draft"
    assert problem["error"] == "duplicate node id 'draft' (nodes[1] and nodes[2])"


def test_parse_fanout_and_engine_are_admitted_storage_kinds():
    data = valid()
    for index, kind in enumerate(("parse", "fanout", "engine")):
        data["nodes"].append({"id": f"k{index}", "kind": kind, "pos": {"x": 0, "y": 0}})
    assert validate_definition(data) == []


def test_gate_nodes_are_rejected_with_each_offending_id():
    data = valid()
    data["nodes"].append({"id": "g1", "kind": "gate", "pos": {"x": 0, "y": 0}})
    data["nodes"].append({"id": "g2", "kind": "gate", "pos": {"x": 0, "y": 0}})
    errors = validate_definition(data)
    assert [e["node_id"] for e in errors] == ["g1", "g2"]
    assert all("'gate' nodes were removed" in e["error"] for e in errors)


def test_a_boolean_position_is_not_numeric():
    data = valid()
    data["nodes"][0]["pos"] = {"x": True, "y": 0}
    assert only_problem(data)["node_id"] == "input"


def test_a_node_without_pos_is_rejected():
    data = valid()
    del data["nodes"][0]["pos"]
    assert only_problem(data)["error"] == "a node needs numeric pos.x and pos.y"


def test_a_chat_node_without_config_needs_a_prompt():
    data = valid()
    del data["nodes"][2]["config"]
    assert only_problem(data)["node_id"] == "check"


def test_a_chat_model_without_a_provider_prefix_names_the_expected_form():
    data = valid()
    data["nodes"][1]["config"]["model"] = "gpt-4"
    problem = only_problem(data)
    assert problem["node_id"] == "draft"
    assert "'provider/model'" in problem["error"] and "'gpt-4'" in problem["error"]


def test_a_chat_model_must_be_a_string():
    data = valid()
    data["nodes"][1]["config"]["model"] = 4
    assert only_problem(data)["node_id"] == "draft"


def test_a_chat_model_with_an_empty_part_is_rejected():
    data = valid()
    data["nodes"][1]["config"]["model"] = "openai/"
    assert only_problem(data)["node_id"] == "draft"


# -- edge rules ------------------------------------------------------------------------------
def test_an_edge_that_is_not_an_object_is_rejected():
    data = valid()
    data["edges"].append(["draft", "check"])
    assert only_problem(data)["error"] == "edges[2] must be an object, got list"


def test_an_edge_label_must_be_a_string():
    data = valid()
    data["edges"][1]["label"] = ["ok"]
    assert only_problem(data)["edge_id"] == "e2"


# -- collection, not fail-fast -------------------------------------------------------------
def test_every_problem_is_reported_in_document_order():
    data = valid()
    data["version"] = 0
    data["nodes"][1]["config"]["model"] = "gpt-4"
    data["nodes"].append({"id": "g", "kind": "gate", "pos": {"x": 0, "y": 0}})
    data["edges"][1]["to"] = "nowhere"
    located = [(e["node_id"], e["edge_id"]) for e in validate_definition(data)]
    assert located == [(None, None), ("draft", None), ("g", None), (None, "e2")]
    with pytest.raises(WorkflowValidationError) as caught:
        load_definition(data)
    assert len(caught.value.errors) == 4
    assert "and 3 more problem(s)" in str(caught.value)


# -- names -----------------------------------------------------------------------------------
def test_a_name_is_trimmed():
    assert normalise_name("  daily-review \n") == "daily-review"


def test_a_blank_name_is_rejected():
    assert validate_name("   ")[0]["error"].startswith("the workflow name is empty")


def test_a_name_of_121_characters_is_rejected_and_120_accepted():
    assert validate_name("x" * 120) == []
    with pytest.raises(WorkflowValidationError, match="121 characters"):
        normalise_name("x" * 121)


@pytest.mark.parametrize("name", ["a\x00b", "tab\tname", "line\nbreak", "esc\x1b[31m", "del\x7f", "a/b", "../up",
                                  "a\\b", "triage@2", "with space", "caf\u00e9", "\u0430dmin", ".", "..", "..."])
def test_a_name_holds_only_letters_digits_dots_dashes_and_underscores(name):
    """Control characters, a path's '/', NAME@VERSION's '@', spaces and look-alike letters are refused
    (issue #32, finding 8): a name is a URL path segment, a file name stem and a reference's left side."""
    problems = validate_name(name)
    assert len(problems) == 1 and "may hold only letters" in problems[0]["error"], problems


def test_the_allowed_characters_make_a_name():
    assert validate_name("Daily_review-2.v1") == [] and validate_name(".hidden-but-named") == []


def test_a_name_must_be_a_string():
    assert validate_name(7) == [
        {"error": "the workflow name must be a string, got int", "node_id": None, "edge_id": None}
    ]


# -- hashing ---------------------------------------------------------------------------------
def test_the_content_hash_is_sha256_of_the_canonical_json():
    import hashlib

    data = {"version": 1, "nodes": [], "edges": [], "inputs": ["b", "a"]}
    encoded = canonical_json(data)
    assert encoded == b'{"edges":[],"inputs":["b","a"],"nodes":[],"version":1}'
    assert content_hash(data) == "sha256:" + hashlib.sha256(encoded).hexdigest()


def test_the_content_hash_is_stable_across_key_order():
    data = valid()
    reordered = json.loads(json.dumps(data, sort_keys=True))
    reordered = {key: reordered[key] for key in reversed(list(reordered))}
    reordered["nodes"] = [{k: n[k] for k in reversed(list(n))} for n in reordered["nodes"]]
    assert list(reordered) != list(data)
    assert content_hash(reordered) == content_hash(data) == load_definition(data).content_hash


def test_the_content_hash_changes_with_the_content():
    data = valid()
    changed = copy.deepcopy(data)
    changed["nodes"][1]["config"]["prompt"] = "Draft a better answer"
    assert content_hash(changed) != content_hash(data)


def test_an_invalid_definition_has_no_hash():
    data = valid()
    data["version"] = 3
    with pytest.raises(WorkflowValidationError):
        content_hash(data)


# -- the error types -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [WorkflowDefinitionError, WorkflowValidationError, WorkflowCompileError])
def test_definition_errors_pickle_with_every_problem_intact(cls):
    errors = [
        {"error": "first", "node_id": "a", "edge_id": None},
        {"error": "second", "node_id": None, "edge_id": "e9"},
    ]
    error = cls(errors)
    copy_ = pickle.loads(pickle.dumps(error))
    assert type(copy_) is cls and isinstance(copy_, OpGraphError)
    assert copy_.errors == errors
    assert (copy_.message, copy_.node_id, copy_.edge_id) == (error.message, "a", None)
    assert copy_.to_dict() == errors[0]


def test_a_single_problem_error_reads_like_the_records_compile_error():
    error = WorkflowCompileError("parse nodes cannot run", node_id="p")
    assert error.to_dict() == {"error": "parse nodes cannot run", "node_id": "p", "edge_id": None}
    assert str(error) == "parse nodes cannot run [node=p]"
