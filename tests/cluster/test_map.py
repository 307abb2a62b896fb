"""`opgraph map` end to end on the shared runtime: a prompt over every row, durable per row, on `sim/`.

    in.jsonl (2,000 rows) -> one live run, a window at a time -> the run store (a row each) -> out.jsonl

The command runs in this process, on the shared Ray (``session``), with a store of its own per
test. "No model call" is counted, not timed: the workers' providers count every call they
make (``provider_calls``). Every bad input is refused before anything is sent, naming where.
"""

from __future__ import annotations

import asyncio
import json
import os

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pa_parquet
import pytest
from workflow_specs import draft_spec

from opgraph.cluster.cli.commands import main as cli_main
from opgraph.cluster.jobs import map as map_rows
from opgraph.cluster.jobs.map import provider_calls
from opgraph.cluster.jobs.output import read_records
from opgraph.cluster.store import MapJobStore


@pytest.fixture
def store(tmp_path):
    return str(tmp_path / "store.db")


def write_rows(path, count: int, *, start: int = 0) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(start, start + count):
            handle.write(json.dumps({"id": index, "text": f"row {index}"}) + "\n")
    return str(path)


def opgraph_map(capsys, *arguments: str) -> tuple[int, dict | None, str]:
    """Run `opgraph map ... --json --plain` here; (exit code, the JSON summary or None, stderr)."""
    code = cli_main(["map", *arguments, "--json", "--plain"])
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("{")]
    return code, (json.loads(lines[-1]) if lines else None), captured.err


def test_two_thousand_rows_give_two_thousand_records_and_the_same_command_again_calls_no_model(
        session, tmp_path, store, capsys):
    source = write_rows(tmp_path / "in.jsonl", 2000)
    output = str(tmp_path / "out.jsonl")
    command = (source, "--prompt", "Classify: {text}", "--id-column", "id", "--output", output, "--store", store,
               "--concurrency", "200")
    before = provider_calls(session)

    code, summary, _ = opgraph_map(capsys, *command)

    assert code == 0, summary
    records = read_records(output)
    assert len(records) == 2000 and len({record["id"] for record in records}) == 2000
    asked = {record["id"]: "reply to " + json.dumps(f"Classify: row {record['id']}") for record in records}
    assert all(record["status"] == "done" and asked[record["id"]] in record["answer"] for record in records)
    assert summary["done"] == 2000 and summary["model_calls"] == 2000
    assert provider_calls(session) - before == 2000  # one call a row, counted by the providers

    counted = provider_calls(session)
    code, again, _ = opgraph_map(capsys, *command)

    assert code == 0 and again["job_id"] == summary["job_id"]
    assert again["recorded_before"] == 2000 and again["done"] == 0
    assert provider_calls(session) == counted  # no model call at all
    assert len(read_records(output)) == 2000
    with MapJobStore(store) as jobs:
        assert jobs.totals(summary["job_id"])["done"] == 2000
        run = jobs.get_run(summary["run_id"])  # recorded as any lane's run: `opgraph run show` reads it
        assert run.lane == "map" and run.status == "completed"


def test_csv_and_parquet_inputs_keep_ids_as_written(session, tmp_path, store, capsys):
    table = pa.table({"id": ["007", "008", "009"], "text": ["a", "b", "c"]})
    pa_csv.write_csv(table, tmp_path / "in.csv")
    pa_parquet.write_table(table, tmp_path / "in.parquet")
    for name in ("in.csv", "in.parquet"):
        output = str(tmp_path / f"{name}.jsonl")
        code, summary, _ = opgraph_map(capsys, str(tmp_path / name), "--prompt", "Say {text}", "--id-column", "id",
                                       "--output", output, "--store", store)
        assert code == 0, summary
        assert sorted(record["id"] for record in read_records(output)) == ["007", "008", "009"]


def test_a_file_url_is_read_like_a_path(session, tmp_path, store, capsys):
    source = write_rows(tmp_path / "in.jsonl", 5)
    code, summary, _ = opgraph_map(capsys, f"file://{source}", "--prompt", "{text}", "--id-column", "id",
                                   "--store", store)
    assert code == 0 and summary["done"] == 5


BAD_JSONL = {
    "not JSON": ('{"id": 1, "text": "a"}\n{"id": 2, "text": \n', "line 2 is not JSON"),
    "no id": ('{"id": 1, "text": "a"}\n{"text": "b"}\n', "line 2 has no id in column 'id'"),
    "repeated id": ('{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n{"id": 1, "text": "c"}\n',
                    "line 3 repeats the id '1' of line 1"),
    "missing field": ('{"id": 1, "text": "a"}\n{"id": 2, "body": "b"}\n', "line 2 has no field 'text'"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_a_bad_row_is_refused_before_any_model_call_naming_its_line(session, tmp_path, store, capsys, case):
    content, said = BAD_JSONL[case]
    (tmp_path / "in.jsonl").write_text(content)
    before = provider_calls(session)
    code, _, err = opgraph_map(capsys, str(tmp_path / "in.jsonl"), "--prompt", "Classify: {text}", "--id-column",
                               "id", "--store", store)
    assert code == 2
    assert said in err
    assert provider_calls(session) == before


def test_bad_rows_are_skipped_and_counted_with_on_bad_row_skip(session, tmp_path, store, capsys):
    lines = [json.dumps({"id": index, "text": f"row {index}"}) for index in range(6)]
    lines[2] = "not json"
    lines[4] = json.dumps({"id": 1, "text": "a repeat"})
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    output = str(tmp_path / "out.jsonl")
    code, summary, _ = opgraph_map(capsys, str(tmp_path / "in.jsonl"), "--prompt", "{text}", "--id-column", "id",
                                   "--on-bad-row", "skip", "--output", output, "--store", store)
    assert code == 0 and summary["refused"] == 2 and summary["done"] == 4
    assert sorted(record["id"] for record in read_records(output)) == ["0", "1", "3", "5"]


@pytest.mark.parametrize("case", ["template field", "schema", "output folder", "schema not JSON"])
def test_a_bad_option_is_refused_before_any_model_call(session, tmp_path, store, capsys, case):
    source = write_rows(tmp_path / "in.jsonl", 3)
    (tmp_path / "bad-schema.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": 7}}}))
    (tmp_path / "broken.json").write_text("{not json")
    arguments = {
        "template field": (["--prompt", "About {subject}"], "line 1 has no field 'subject', which the template needs"),
        "schema": (["--prompt", "{text}", "--schema", str(tmp_path / "bad-schema.json")],
                   "is not valid JSON Schema: at properties/a/type"),
        "output folder": (["--prompt", "{text}", "--output", str(tmp_path / "missing" / "out.jsonl")],
                          "does not exist"),
        "schema not JSON": (["--prompt", "{text}", "--schema", str(tmp_path / "broken.json")], "is not JSON"),
    }[case]
    before = provider_calls(session)
    code, _, err = opgraph_map(capsys, source, *arguments[0], "--id-column", "id", "--store", store)
    assert code == 2 and arguments[1] in err
    assert provider_calls(session) == before


def test_a_csv_without_the_template_column_is_refused_naming_it(session, tmp_path, store, capsys):
    pa_csv.write_csv(pa.table({"id": ["1"], "body": ["x"]}), tmp_path / "in.csv")
    code, _, err = opgraph_map(capsys, str(tmp_path / "in.csv"), "--prompt", "{text}", "--id-column", "id",
                               "--store", store)
    assert code == 2 and "the field 'text' is not a column of" in err


def test_an_input_changed_since_its_job_ran_is_refused_unless_a_new_job_is_asked_for(session, tmp_path, store,
                                                                                     capsys):
    source = write_rows(tmp_path / "in.jsonl", 4)
    command = (source, "--prompt", "{text}", "--id-column", "id", "--store", store)
    code, first, _ = opgraph_map(capsys, *command)
    assert code == 0
    write_rows(tmp_path / "in.jsonl", 5)
    before = provider_calls(session)
    code, _, err = opgraph_map(capsys, *command)
    assert code == 2 and f"changed since job {first['job_id']} ran on it" in err and "--new-job" in err
    assert provider_calls(session) == before
    code, second, _ = opgraph_map(capsys, *command, "--new-job")
    assert code == 0 and second["job_id"] != first["job_id"] and second["done"] == 5


def test_a_dry_run_counts_and_estimates_and_calls_no_model(session, tmp_path, store, capsys):
    source = write_rows(tmp_path / "in.jsonl", 50)
    before = provider_calls(session)
    code, estimate, _ = opgraph_map(capsys, source, "--prompt", "Classify: {text}", "--id-column", "id",
                                    "--store", store, "--dry-run", "--model", "openai/gpt-x", "--price",
                                    "openai/gpt-x=1,2")
    assert code == 0 and estimate["rows"] == 50 and estimate["model_calls"] == 0
    assert estimate["prompt_chars"] == sum(len(f"Classify: row {index}") for index in range(50))
    assert estimate["tokens_counted_by"]  # says whether a tokenizer or the 4-characters estimate counted them
    assert estimate["cost_usd"] > 0
    assert provider_calls(session) == before
    assert not os.path.exists(store)  # nothing stored either


def test_a_schema_answer_gets_a_repair_turn_and_a_row_failing_after_it_is_recorded_failed(session, tmp_path, store,
                                                                                          capsys):
    """sim/malformed breaks a quarter of its structured replies: those rows take a repair turn."""
    source = write_rows(tmp_path / "in.jsonl", 120)
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["spam", "ham"]}},
              "required": ["label"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    output = str(tmp_path / "out.jsonl")
    code, summary, _ = opgraph_map(capsys, source, "--prompt", "Classify: {text}", "--id-column", "id", "--schema",
                                   str(tmp_path / "schema.json"), "--model", "sim/malformed", "--output", output,
                                   "--store", store)
    records = read_records(output)
    assert len(records) == 120
    done = [record for record in records if record["status"] == "done"]
    failed = [record for record in records if record["status"] == "failed"]
    assert all(record["answer"]["label"] in ("spam", "ham") for record in done)
    assert all("could not be parsed" in record["error"] and record["usage"]["calls"] == 2 for record in failed)
    assert sum(record["usage"]["calls"] for record in records) > 120  # repair turns were taken
    assert any(record["usage"]["calls"] == 2 for record in done)  # and some repaired
    assert code == (1 if failed else 0) and summary["failed"] == len(failed)


def test_a_budget_stops_admissions_finishes_what_is_in_flight_and_reports_what_remains(session, tmp_path, store,
                                                                                       capsys):
    source = write_rows(tmp_path / "in.jsonl", 200)
    command = (source, "--prompt", "Classify: {text}", "--id-column", "id", "--store", store, "--concurrency", "4",
               "--output", str(tmp_path / "out.jsonl"))
    code, summary, _ = opgraph_map(capsys, *command, "--max-tokens", "1000")
    assert code == 4  # DEGRADED: stopped by its budget, rows left
    assert summary["stopped"] == "tokens" and 0 < summary["done"] < 200
    assert summary["remaining"] == 200 - summary["done"]
    assert summary["tokens"] < 1000 + 8 * 40  # at most what the rows in flight at the stop spent beyond it
    code, rest, _ = opgraph_map(capsys, *command)  # the same job, no budget: it finishes
    assert code == 0 and rest["done"] == 200 - summary["done"]
    assert len(read_records(tmp_path / "out.jsonl")) == 200


def test_retry_failed_runs_only_the_failed_rows_again(session, tmp_path, store, capsys):
    """sim/flaky fails a quarter of its calls: those rows are recorded failed; --retry-failed runs them alone."""
    source = write_rows(tmp_path / "in.jsonl", 60)
    output = str(tmp_path / "out.jsonl")
    command = (source, "--prompt", "{text}", "--id-column", "id", "--model", "sim/flaky", "--output", output,
               "--store", store)
    code, first, _ = opgraph_map(capsys, *command)
    assert first["failed"] > 0 and code == 1
    counted = provider_calls(session)
    code, retried, _ = opgraph_map(capsys, *command, "--retry-failed")
    assert provider_calls(session) - counted == first["failed"]  # the failed rows, and no other
    assert retried["done"] + retried["failed"] == first["failed"] and retried["failed"] < first["failed"]
    records = read_records(output)
    assert len(records) == 60 and len({record["id"] for record in records}) == 60


def test_a_stored_workflow_runs_per_row_with_the_row_as_its_inputs(session, tmp_path, store, capsys):
    (tmp_path / "draft.json").write_text(json.dumps(draft_spec(prompt="Draft about the topic")))
    assert cli_main(["workflows", "add", "drafts", str(tmp_path / "draft.json"), "--store", store]) == 0
    capsys.readouterr()
    with open(tmp_path / "in.jsonl", "w") as handle:
        for index in range(6):
            handle.write(json.dumps({"id": f"t{index}", "topic": f"topic {index}"}) + "\n")
    output = str(tmp_path / "out.jsonl")
    code, summary, _ = opgraph_map(capsys, str(tmp_path / "in.jsonl"), "--workflow", "drafts@1", "--id-column", "id",
                                   "--output", output, "--store", store, "--concurrency", "3")
    assert code == 0, summary
    records = read_records(output)
    assert sorted(record["id"] for record in records) == [f"t{index}" for index in range(6)]
    assert all(record["status"] == "done" and "draft" in record["answer"] for record in records)


def test_export_writes_the_output_again_from_the_store(session, tmp_path, store, capsys):
    source = write_rows(tmp_path / "in.jsonl", 30)
    code, summary, _ = opgraph_map(capsys, source, "--prompt", "{text}", "--id-column", "id", "--store", store)
    assert code == 0
    assert cli_main(["map", "export", summary["job_id"][:8], "--output", str(tmp_path / "again.jsonl"),
                     "--store", store]) == 0
    records = read_records(tmp_path / "again.jsonl")
    assert [record["id"] for record in records] == [str(index) for index in range(30)]  # input order


def test_the_python_form_yields_each_row_and_again_yields_the_recorded_ones_without_calls(session, store):
    rows = [{"id": index, "text": f"row {index}"} for index in range(40)]

    async def collect() -> list:
        return [outcome async for outcome in map_rows(rows, prompt="Classify: {text}", session=session,
                                                      store=store, concurrency=8)]

    first = asyncio.run(collect())
    counted = provider_calls(session)
    again = asyncio.run(collect())
    assert sorted(outcome.row_key for outcome in first) == sorted(str(index) for index in range(40))
    assert {outcome.row_key for outcome in again} == {outcome.row_key for outcome in first}
    assert provider_calls(session) == counted


def test_a_batch_of_rows_answers_each_row_alone_a_failed_call_failing_only_its_row():
    """One operation carries several rows, called at once; a failing model call fails its row alone,
    with why and what it cost, and each answer travels as the JSON text that is stored."""
    from opgraph.actors.models import ProviderUnavailable
    from opgraph.actors.providers import SimulatedProvider
    from opgraph.cluster.jobs.answers import RowTask, answer_rows, decode_answers

    class FailsRowTwo(SimulatedProvider):
        async def complete(self, request):
            if request.messages[-1]["content"].endswith("row 2"):
                raise ProviderUnavailable("row 2 is refused", provider="sim", status=503)
            return await super().complete(request)

    class Branch:
        default_model, node_id = "sim/default", "n"

        def provider_for(self, model):
            return FailsRowTwo(latency=0.0)

    prompts = [f"Classify: row {index}" for index in range(4)]
    answers = decode_answers(asyncio.run(answer_rows(Branch(), prompts, task=RowTask())))
    assert [ok for ok, *_ in answers] == [True, True, False, True]
    assert all(json.dumps(f"Classify: row {index}") in json.loads(answers[index][1])
               for index in (0, 1, 3))
    assert answers[2][1].startswith("ProviderUnavailable: row 2 is refused") and answers[2][2] == 0
    assert all(answer[2:] == (1, answer[3], 32, "sim/default") and answer[3] > 0 for answer in answers if answer[0])


def test_the_rows_an_operation_carries_keep_the_rows_in_flight_within_the_concurrency():
    from opgraph.cluster.jobs.feeding import batch_size

    assert [batch_size(concurrency) for concurrency in (1, 20, 32, 64, 200)] == [1, 1, 1, 2, 6]
    for concurrency in (1, 20, 64, 200, 256, 500, 1000, 1024, 5000):
        size = batch_size(concurrency)
        assert 1 <= size <= 32 and (concurrency // size) * size >= 0.98 * concurrency
    assert batch_size(1000) == 31 and batch_size(1024) == 32


def test_the_batch_sizer_batches_even_rows_and_not_rows_whose_call_times_spread():
    """Even 50 ms calls: 16 rows an operation once 256 rows were timed (one each before). Log-normal
    calls (median 1 s, p99 about 8 s, a real model's spread): 16 rows would be held for their
    slowest, so they go one or two an operation. --batch N never changes."""
    import random

    from opgraph.cluster.jobs.feeding import BatchSizer

    even = BatchSizer(16)
    assert even.observe([0.05] * 100, now=0.0) == 1  # not seen enough yet
    assert even.observe([0.05] * 200, now=0.1) == 16
    draw = random.Random(7)
    spread = BatchSizer(16)
    assert spread.observe([draw.lognormvariate(0.0, 0.894) for _ in range(1000)], now=0.0) <= 2
    # The choice is made again at most once a second, from the times seen since.
    assert spread.observe([1.0] * 4096, now=0.5) <= 2
    assert spread.observe([1.0], now=1.5) == 16
    fixed = BatchSizer(8, fixed=True)
    assert fixed.observe([draw.lognormvariate(0.0, 0.894) for _ in range(1000)], now=0.0) == 8


def test_an_operation_of_several_rows_weighs_its_rows_in_the_runs_capacity():
    from opgraph.cluster.jobs.feeding import _operation
    from opgraph.kernel import create_operation, node_weight

    _, _, _, metadata = _operation("job", [0, 1, 2], ["a", "b", "c"], ["p0", "p1", "p2"])
    assert metadata["weight"] == 3
    _, _, _, single = _operation("job", [0], ["a"], ["p0"])
    assert "weight" not in single
    node = create_operation("map_rows", {})
    node.metadata.update(metadata)
    assert node_weight(node) == 3
