"""The engine surfaces: `opgraph engine run`, `opgraph run show`, metrics, the sim provider's values, errors.

CLI tests call ``opgraph.cluster.cli.main`` in this process: bad input must exit 2 before
any runtime starts; a real run joins the shared test Ray and records into a temp store.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from opgraph.actors import TurnError
from opgraph.actors.models import ChatRequest
from opgraph.actors.providers import SimulatedProvider, example_from_schema
from opgraph.cluster.cli import main
from opgraph.cluster.metrics import engine_metric_families
from opgraph.cluster.store import EngineRunStore
from opgraph.engines import (
    EngineBudgetError,
    EngineError,
    EngineInputError,
    EventSinkError,
    PlanError,
    engine_statistics,
)

CODE = "def load(path):\n    return eval(open(path).read())\n"


# -- bad input: exit 2, nothing started ------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["engine", "run", "planning", "   "], "non-empty prompt"),
    (["engine", "run", "poetry", "a prompt"], "unknown engine kind"),
    (["engine", "run", "review", "/no/such/path"], "does not exist"),
    (["engine", "run", "planning", "a prompt", "--max-agents", "0"], "max_agents"),
    (["engine", "run", "planning", "a prompt", "--deadline", "-5"], "deadline_s"),
    (["engine", "run", "planning", "a prompt", "--max-tokens", "0"], "max_tokens"),
    (["engine", "run", "planning", "a prompt", "--model", "gpt-4"], "provider prefix"),
    (["engine", "run", "research", "  "], "non-empty topic"),
    (["engine", "run", "hypothesis", " ", "\t"], "at least one non-empty seed"),
    (["engine", "run", "research", "a topic", "--novelty-threshold", "1.5"], "novelty_threshold"),
    (["engine", "run", "planning", "a prompt", "--novelty-threshold", "0.5"], "applies to research runs only"),
    (["engine", "run", "hypothesis", "a seed", "--max-questions", "0"], "max_questions"),
    (["engine", "run", "review", "a.py", "b.py"], "one file or folder"),
])
def test_bad_input_exits_2_before_anything_starts(argv, message, capsys, monkeypatch, tmp_path):
    import opgraph.actors.driver.session as session_module

    def no_session(*args, **kwargs):
        raise AssertionError("a Session was started for bad input")

    monkeypatch.setattr(session_module, "Session", no_session)
    assert main([*argv, "--store", str(tmp_path / "db")]) == 2
    assert message in capsys.readouterr().err


def test_bad_input_with_json_prints_a_json_refusal(capsys, tmp_path):
    assert main(["engine", "run", "poetry", "a prompt", "--json", "--store", str(tmp_path / "db")]) == 2
    refusal = json.loads(capsys.readouterr().out)
    assert refusal["status"] == "invalid" and refusal["error_type"] == "EngineInputError"
    assert "unknown engine kind" in refusal["error"]


def test_an_empty_review_folder_is_bad_input(tmp_path, capsys):
    (tmp_path / "code").mkdir()
    assert main(["engine", "run", "review", str(tmp_path / "code"), "--store", str(tmp_path / "db")]) == 2
    assert "no text to review" in capsys.readouterr().err


# -- real runs through the CLI ---------------------------------------------------------------


@pytest.mark.ray
def test_engine_run_review_on_sim_prints_the_run_id_and_the_result_last(session, tmp_path, capsys):
    target = tmp_path / "loader.py"
    target.write_text(CODE)
    store = str(tmp_path / "opgraph.db")
    assert main(["engine", "run", "review", str(target), "--store", store, "--plain"]) == 0
    captured = capsys.readouterr()
    run_id = captured.err.split("engine run ", 1)[1].split()[0]
    assert captured.out.startswith("Review verdict: ") and "Evidence (4 issue(s)" in captured.out
    assert "agent_created" in captured.err  # plain progress lines
    with EngineRunStore(store) as runs:
        assert runs.get_run(run_id).status == "completed"


@pytest.mark.ray
def test_engine_run_research_on_sim_prints_a_tree_of_findings(session, tmp_path, capsys):
    store = str(tmp_path / "opgraph.db")
    code = main(["engine", "run", "research", "solid-state", "batteries", "--max-depth", "1", "--store", store,
                 "--plain"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # One level deep: the root and its children (how many, sim/'s text decides).
    assert re.match(r"Research: solid-state batteries\nStatus: complete · [2-9] node\(s\)", captured.out)
    # sim/ writes sentences about the topic, not placeholder ids.
    assert "sim-" not in captured.out and captured.out.count("solid-state batteries") > 5
    assert "Findings tree:\n● solid-state batteries\n│ F1 [" in captured.out and "└── ● " in captured.out
    run_id = captured.err.split("engine run ", 1)[1].split()[0]
    assert main(["run", "show", run_id, "--store", store]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"engine run {run_id}  research  completed")
    for kind in ("node_opened", "FindingEmitted", "finding_retained", "DepthRequested", "ContradictionFound"):
        assert kind in shown


@pytest.mark.ray
def test_engine_run_hypothesis_on_sim_takes_several_seeds(session, tmp_path, capsys):
    store = str(tmp_path / "opgraph.db")
    code = main(["engine", "run", "hypothesis", "cells fade in the cold", "anodes swell", "--max-questions", "2",
                 "--store", store, "--plain", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["engine"] == "hypothesis" and payload["status"] == "completed"
    assert "F1 finding: cells fade in the cold" in payload["text"]
    assert "F2 finding: anodes swell" in payload["text"]
    with EngineRunStore(store) as runs:
        record = runs.get_run(payload["run_id"])
    assert record.inputs == {"seeds": ["cells fade in the cold", "anodes swell"]}
    assert record.config["max_questions"] == 2


@pytest.mark.ray
def test_run_show_lists_an_engine_runs_events(session, tmp_path, capsys):
    store = str(tmp_path / "opgraph.db")
    assert main(["engine", "run", "planning", "plan a picnic", "--store", store, "--plain", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert main(["run", "show", payload["run_id"], "--store", store]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"engine run {payload['run_id']}  planning  completed")
    for kind in ("run_started", "agent_created", "PlanProposed", "dag_progress", "TaskSettled", "run_finished"):
        assert kind in shown
    assert main(["run", "show", payload["run_id"], "--store", store, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["events"][0]["seq"] == 1 and data["events"][-1]["type"] == "run_finished"


@pytest.mark.ray
def test_a_degraded_run_exits_4_with_its_partial_result(session, tmp_path, capsys):
    target = tmp_path / "loader.py"
    target.write_text(CODE)
    code = main(["engine", "run", "review", str(target), "--max-agents", "2", "--store", str(tmp_path / "db"),
                 "--plain", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 4 and payload["degraded"] and payload["degrade_reason"] == "budget"


def test_an_address_that_does_not_answer_exits_3_before_any_run(tmp_path, capsys):
    """As for every command: the address is probed first; nothing is recorded, no agent made."""
    from opgraph.cluster.processes import free_port

    refused = f"127.0.0.1:{free_port()}"  # closed again: connections are refused
    code = main(["engine", "run", "planning", "a prompt", "--address", refused, "--json",
                 "--store", str(tmp_path / "db")])
    captured = capsys.readouterr()
    assert code == 3 and f"cannot reach a Ray cluster at {refused}" in captured.err
    refusal = json.loads(captured.out)
    assert refusal["status"] == "not_started" and refusal["error_type"] == "ClusterUnreachableError"
    assert "engine run" not in captured.err  # no run id was ever printed: nothing ran


def test_run_show_of_an_unknown_id_exits_1(tmp_path, capsys):
    assert main(["run", "show", "no-such-run", "--store", str(tmp_path / "db")]) == 1
    assert "no engine or workflow run" in capsys.readouterr().err


# -- metrics ----------------------------------------------------------------------------------


def test_engine_metric_families_translate_snapshots():
    snapshot = {"review": {"runs_started": 2, "agents_made": 9, "emissions_missing": 1,
                           "budget_exhaustions": {"agents": 1}, "judge_outcomes": {"allow": 3},
                           "runs_finished": {"completed": 1, "degraded": 1}}}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in engine_metric_families(snapshot) for s in family.samples}
    assert samples[("opgraph_engine_agents_made_total", (("engine", "review"),))] == 9
    assert samples[("opgraph_engine_budget_exhaustions_total", (("engine", "review"), ("reason", "agents")))] == 1
    assert samples[("opgraph_engine_judge_outcomes_total", (("engine", "review"), ("outcome", "allow")))] == 3


@pytest.mark.ray
def test_engine_statistics_count_agents_and_exhaustions_per_engine(session, tmp_path):
    before = engine_statistics().get("review", {}).get("agents_made", 0)
    target = tmp_path / "loader.py"
    target.write_text(CODE)
    assert main(["engine", "run", "review", str(target), "--max-agents", "2", "--store", str(tmp_path / "db"),
                 "--plain"]) == 4
    stats = engine_statistics()["review"]
    assert stats["agents_made"] == before + 2 and stats["budget_exhaustions"].get("agents", 0) >= 1
    with EngineRunStore(tmp_path / "db") as store:
        assert store.statistics()["review"]["agents_made"] == 2


# -- the sim provider's structured answers -------------------------------------------------------


class Part(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2}$")
    weight: float = Field(gt=0, le=2.5)


class Order(BaseModel):
    id: int = Field(ge=100, lt=200, multiple_of=5)
    kind: Literal["retail", "wholesale"]
    note: str = Field(min_length=12, max_length=20)
    parts: list[Part] = Field(min_length=2, max_length=3)
    tags: set[str] = set()
    extra: dict[str, int] = Field(default_factory=dict)
    pair: tuple[int, str]
    maybe: Part | None = None


def test_sim_values_fit_a_constrained_pydantic_schema():
    for list_items in (0, 1, 5):
        Order.model_validate(example_from_schema(Order.model_json_schema(), hint="h", list_items=list_items))


def structured(provider: SimulatedProvider, model_class: type[BaseModel], text: str = "go") -> str:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": model_class.model_json_schema()}}
    request = ChatRequest("sim/default", [{"role": "user", "content": text}], response_format=response_format)
    return asyncio.run(provider.complete(request)).content


def test_sim_malformed_rate_breaks_structured_replies_only():
    broken = SimulatedProvider(latency=0.0, malformed_rate=1.0, seed=1)
    for index in range(6):
        with pytest.raises(ValidationError):
            Order.model_validate_json(structured(broken, Order, f"ask {index}"))
    plain = asyncio.run(broken.complete(ChatRequest("sim/default", [{"role": "user", "content": "hi"}]))).content
    assert "simulated reply" in plain


def test_sim_list_items_sets_the_length_of_lists():
    class Many(BaseModel):
        items: list[str]

    reply = Many.model_validate_json(structured(SimulatedProvider(latency=0.0, list_items=4), Many))
    assert len(reply.items) == 4 and len(set(reply.items)) == 4


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    EngineError("x", run_id="r1", node_id="n"),
    EngineInputError("bad", run_id="r1"),
    EngineBudgetError("spent", reason="tokens", run_id="r1", branch_id="b"),
    PlanError("empty", run_id="r1"),
    EventSinkError("disk", run_id="r1"),
    TurnError("parse", error_type="ParseError", usage={"total_tokens": 7}, branch_id="b"),
])
def test_engine_errors_pickle_with_their_ids(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


def test_engine_errors_keep_the_records_base_types():
    assert issubclass(EngineBudgetError, RuntimeError) and issubclass(EngineInputError, ValueError)
    assert "run=r1" in str(PlanError("empty", run_id="r1"))


@pytest.mark.ray
def test_the_metrics_endpoint_serves_engine_counters(session, tmp_path):
    import urllib.request

    from opgraph.cluster.metrics import serve_metrics

    target = tmp_path / "loader.py"
    target.write_text(CODE)
    assert main(["engine", "run", "review", str(target), "--store", str(tmp_path / "db"), "--plain"]) == 0
    with serve_metrics(session, port=0) as server:
        text = urllib.request.urlopen(server.url, timeout=10).read().decode()
    prefix = 'opgraph_engine_agents_made_total{engine="review"}'
    agents = [line for line in text.splitlines() if line.startswith(prefix)]
    assert agents and float(agents[0].split()[-1]) >= 5


class _NoRuntime:
    """A port that is never called: the progress display only reads the run's budget."""

    session = None


def test_live_progress_on_a_terminal_shows_agents_events_and_budget():
    import io

    from rich.console import Console

    from opgraph.cluster.cli.engine import EngineProgress
    from opgraph.engines import ReviewEngine

    screen = io.StringIO()
    run_ = ReviewEngine(max_tokens=500).new_run(port=_NoRuntime())
    progress = EngineProgress(console=Console(file=screen, force_terminal=True, width=160), live=True).attach(run_)
    with progress:
        progress({"type": "agent_created", "agent": "reviewer-security", "role": "reviewer"})
    shown = screen.getvalue()
    assert "events 1" in shown and "agents 0/50" in shown and "tokens 0/500" in shown
    assert "reviewer-security" in shown
