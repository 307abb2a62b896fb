"""Every command and complete Python program shown in README.md and docs/*.md runs, or says why not.

    a Ray head of this module, with token authentication (`ray start --head ... --block`, as
    docs/operating.md shows it, on free ports; the doc's options are checked against it)
      <- every documented command and program, each in its own process group, on one temp
         store (OPGRAPH_HOME, OPGRAPH_DB), joined to the head through RAY_ADDRESS so that none
         pays for a Ray start of its own
      <- the README's `opgraph demo`, the front door, as written: on an embedded Ray of its own

One module fixture runs the documentation once: each item after the items it names in
``after`` (a stored workflow, a server, the run a RUN_ID comes from), the rest side by side,
three at a time. Each test then asserts one item's exit status and output. What is not run
says why in its test id; what cannot run here for minutes is parsed instead. A meta-test
fails when a documented command or program has no check here, or a check no longer matches
the docs. The ports the docs show (8000, 9464, 6379, 8265) are mapped to free ones or the
head's, and commands on the head run without a warm spare executor each (it changes no
output; see Documentation.env).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from documented_commands import (
    BLOCK_KINDS,
    COMMAND_BLOCKS,
    REPOSITORY,
    AfterInstall,
    Environment,
    Export,
    HeadFixture,
    NotRun,
    Outcome,
    ParsedOnly,
    Run,
    Serve,
    Service,
    documents,
    free_port,
    help_of,
    read_blocks,
    read_commands,
    run_shell,
)

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
JSON_RUN_ID = r'"run_id": ?"([^"]+)"'
POLL_DEADLINE = 120.0  # seconds a polled command may keep answering "not yet"
# The first test to ask for the documentation's run waits for all of it (the head's start included).
DOCUMENTATION_DEADLINE = 900
SIDE_BY_SIDE = 3  # items run at once: most of a command's time is process and actor start-up
CONTINUATION_ROOM = 2  # places beyond SIDE_BY_SIDE that only items following a started one may take
MINUTES = "runs for minutes; the README's scaled-down `opgraph bench` runs for real"

# The README's set-up installs the `local` extra too, with the flags its llama.cpp build needs (.ci/run's).
LOCAL_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF '
               '-DGGML_AVX512=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"')
INSTALL = f"{LOCAL_BUILD} pip install -e '.[test,local]'"
# How the docs call `opgraph serve`: with the token `export OPGRAPH_TOKEN=$(opgraph token)` read.
CURL = 'curl -s -H "Authorization: Bearer $OPGRAPH_TOKEN"'
ADD = "opgraph workflows add triage cluster/lanes/fixed/examples/support-triage.json"

# Every documented command, exactly as shown, and how it is checked. ``after`` names what must
# have run first: what the docs say comes first (a stored workflow, a server, the run an id is from).
CHECKS = {
    # README.md
    f"{INSTALL} && opgraph demo": AfterInstall(INSTALL, Run(r"run \S+ completed(.|\n)*escalate:", embedded=True,
                                                           early=True)),
    "python -m pytest -q": NotRun("the test command itself; test_the_readme_commands_are_what_ci_runs checks it"),
    "opgraph demo --kernel": Run(r"status=completed completed=4"),
    ADD: Run(r"added triage@1 sha256:", name="triage"),
    'opgraph flow run triage --input ticket="card payments fail" --input priority=high':
        Run(r"escalate:", capture=rf"run ({UUID}) completed", name="flow run", after=("triage",)),
    "opgraph run result $RUN_ID": Run(r'"status": "completed"', after=("flow run",)),
    'opgraph o flow "compare three battery chemistries" --max-ops 6': Run(r"completed"),
    'opgraph play research-brief "solid-state batteries" --words 200': Run(r"completed"),
    'opgraph engine run planning "Plan a launch checklist for a small web service"':
        Run(r"engine run \S+ completed"),
    "opgraph bench --shapes fanout-0ms,chain --nodes 200 --repeat 1": Run(r"chain"),
    "export RAY_AUTH_MODE=token": Environment(),
    "python -m opgraph.cluster.job fanout --detach --address 127.0.0.1:6379 --nodes 1200 --latency 0.5 "
    "--max-concurrent 20 --run-id tour-1": Run(r'"status": "submitted"', name="tour", early=True),
    "opgraph run status tour-1 --address 127.0.0.1:6379": Run(r'"settled"', after=("tour",)),
    "opgraph run watch tour-1 --address 127.0.0.1:6379 --limit 3": Run(r'"status": "completed"', after=("tour",)),
    "opgraph run result tour-1 --address 127.0.0.1:6379": Run(r'"status": "completed"', after=("tour",)),
    "opgraph serve --port 8000": Serve("http://127.0.0.1:8000/api/workflows", name="serve"),
    "export OPGRAPH_TOKEN=$(opgraph token)": Export(r"[A-Za-z0-9_-]{32,}", name="token", after=("serve",)),
    f"{CURL} http://127.0.0.1:8000/api/workflows": Run(r'"name":"triage"', after=("token", "triage")),
    f"{CURL} -X POST http://127.0.0.1:8000/api/workflows/triage/runs -H 'content-type: application/json' "
    """-d '{"inputs": {"ticket": "card payments fail", "priority": "low"}}'""":
        Run(r'"lane":"fixed_workflow"', capture=JSON_RUN_ID, name="triage run", after=("token", "triage")),
    f"{CURL} http://127.0.0.1:8000/api/runs/$RUN_ID": Run(r'"workflow":"triage"', after=("triage run",)),
    f"{CURL} http://127.0.0.1:8000/api/runs/$RUN_ID/results":
        Run(r'"draft_reply":\{"status":"completed"', poll=True, after=("triage run",)),
    # docs/benchmarks.md
    "opgraph bench --repeat 5": ParsedOnly(MINUTES),
    "opgraph bench --shapes fanout-50ms,spawns-returned --repeat 5": ParsedOnly(MINUTES),
    "python -m opgraph.cluster.bench.chain_costs --links 300 --repeat 3": ParsedOnly(MINUTES),
    "python -m opgraph.cluster.bench.million --sizes 100000,1000000": ParsedOnly(MINUTES),
    "opgraph bench --repeat 3 --compare lionagi,langgraph": ParsedOnly(MINUTES),
    "opgraph bench --compare durability --repeat 5": ParsedOnly(MINUTES),
    # A CI-size run of these is tests/cluster/test_http_bench.py.
    "opgraph bench --shapes http,http-stream --compare lionagi,langgraph": ParsedOnly(MINUTES),
    "python -m opgraph.cluster.bench.runlog --postgres postgresql://user@db-host:5432/opgraph --records 20000 "
    "--repeat 5 --runtime --nodes 5000": ParsedOnly("runs for minutes and needs that PostgreSQL server"),
    "python -m opgraph.cluster.bench.goodput --repeat 3": ParsedOnly(MINUTES),
    "python -m opgraph.cluster.bench.pool --repeat 5": ParsedOnly(MINUTES),
    # A CI-size run of it is in tests/cluster/test_bench.py.
    "opgraph bench --shapes engines --repeat 3": ParsedOnly(MINUTES),
    # docs/cli.md
    "opgraph --help": Run(r"workflows"),
    # docs/cli.md, dataset jobs
    'opgraph map docs/examples/tickets.jsonl --prompt "Classify this support ticket: {text}" --id-column id '
    "--output /tmp/tickets.out.jsonl": Run(r"job \S+ completed: \d+ done"),
    'opgraph map docs/examples/tickets.jsonl --prompt "Classify this support ticket: {text}" --id-column id '
    "--dry-run": Run(r"dry run: 20 rows to run"),
    "opgraph flow run --help": Run(r"NAME-OR-FILE"),
    # docs/http.md
    f"{CURL} -X POST http://127.0.0.1:8000/api/workflows -H 'content-type: application/json' "
    """-d '{"name": "drafts", "spec": {"version": 1, "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, """
    """"y": 0}}, {"id": "draft", "kind": "chat", "pos": {"x": 1, "y": 0}, "config": {"prompt": "Draft a short """
    """note about the topic."}}], "edges": [{"id": "e1", "from": "in", "to": "draft"}], "inputs": ["topic"], """
    """"outputs": ["draft"]}}'""": Run(r'"ref":"drafts@1"', name="drafts", after=("token",)),
    f"{CURL} http://127.0.0.1:8000/api/workflows/drafts/versions":
        Run(r'"name":"drafts","versions":\[', after=("drafts",)),
    f"{CURL} -X POST http://127.0.0.1:8000/api/workflows/drafts/runs -H 'content-type: application/json' "
    """-d '{"inputs": {"topic": "actors"}}'""":
        Run(r'"workflow":"drafts"', capture=JSON_RUN_ID, name="drafts run", after=("drafts",)),
    f'{CURL} "http://127.0.0.1:8000/api/runs/$RUN_ID/signals?after=0"': Run(r'"signals":\[', after=("drafts run",)),
    f"{CURL} -X POST http://127.0.0.1:8000/api/runs/$RUN_ID/pause":
        Run(r'"lane":"fixed_workflow"|already ended', after=("drafts run",)),
    f"{CURL} -X POST http://127.0.0.1:8000/api/flows/runs -H 'content-type: application/json' "
    """-d '{"prompt": "compare three battery chemistries", "max_ops": 6}'""":
        Run(r'"lane":"planned_reactive_flow"', after=("token",)),
    # docs/operating.md
    "ray start --head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 --block": HeadFixture(),
    "opgraph job submit --address http://127.0.0.1:8265 -- fanout --nodes 2000 --latency 0.01 --max-concurrent 200":
        Run(r"succeeded", early=True),
    "ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env-json "
    '"$(opgraph job runtime-env)" -- python -m opgraph.cluster.job fanout --nodes 2000 --latency 0.01 '
    "--max-concurrent 200": Run(r"succeeded", early=True),
    "opgraph job submit --address http://127.0.0.1:8265 -- map docs/examples/tickets.jsonl --prompt "
    '"Classify this support ticket: {text}" --id-column id --output /tmp/tickets.job.jsonl':
        Run(r"succeeded", early=True),
    "opgraph metrics serve --address 127.0.0.1:6379 --port 9464":
        Serve("http://127.0.0.1:9464/metrics", name="metrics"),
    "curl -s http://127.0.0.1:9464/metrics": Run(r"opgraph_up", after=("metrics",)),
    "opgraph runs list --limit 5": Run(r"fixed_workflow +completed", after=("flow run",)),
    "opgraph runs prune --older-than 30d --keep-last 200 --dry-run":
        Run(r"would delete 0 of \d+ matching runs(.|\n)*nothing was deleted \(dry run\)", after=("flow run",)),
    "opgraph runs prune --status failed --older-than 7d": Run(r"deleted 0 of 0 matching runs", after=("flow run",)),
    "opgraph store vacuum": Run(r"vacuum: [\d.]+ MB -> [\d.]+ MB", after=("flow run",)),
    # docs/python.md
    "python -m opgraph.cluster.example_three_nodes": Run(r"run completed: 4 nodes"),
    # docs/workflows.md
    "opgraph workflows list": Run(r"triage", after=("triage",)),
    "opgraph workflows versions triage": Run(r"triage@1", after=("triage",)),
    "opgraph workflows show triage@1": Run(r'"name": "triage"', after=("triage",)),
    'opgraph flow run triage@1 --input ticket="printer on fire" --input priority=low --json':
        Run(r'"status": "completed"', after=("triage",)),
    "opgraph play list": Run(r"research-brief"),
    'opgraph engine run research "solid-state batteries" --max-depth 2': Run(r"Findings tree"),
    'opgraph engine run hypothesis "sodium-ion cells lose capacity fast below -10 C" "LFP cathodes tolerate heat"':
        Run(r"F1 finding: sodium-ion"),
    'opgraph engine run coding "make add() add its arguments" --workspace docs/examples/adder '
    '--test-cmd "python -m pytest -q" --max-fix-rounds 1': Run(r"Coding verdict: ", exit=5),
    'opgraph play check research-brief "solid-state batteries"': Run(r'"ok": true'),
}

# Every complete program (a `python` block), by a line only it has, and how it is checked.
PROGRAMS = {
    "async def shout(branch": Run(r"completed \['completed', 'completed', 'completed', 'completed'\]"),
    "def fan_out(width, seconds):": Run(r"paused: True\nflow: completed 40 nodes\nfirst settled: \w+\n"
                                        r"turn: \d+ tokens"),
}


# -- what the docs hold, read once at collection ---------------------------------------------------
def _read_documentation():
    blocks, commands, problems = [], [], []
    for path in documents():
        try:
            found = read_blocks(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        blocks.extend(found)
        for block in found:
            if block.tag in COMMAND_BLOCKS:
                try:
                    commands.extend(read_commands(block))
                except ValueError as exc:
                    problems.append(str(exc))
    return blocks, commands, problems


BLOCKS, COMMANDS, READ_PROBLEMS = _read_documentation()
PROGRAM_BLOCKS = [block for block in BLOCKS if block.tag == "python"]


def _program_key(block) -> str | None:
    keys = [key for key in PROGRAMS if key in block.text]
    return keys[0] if len(keys) == 1 else None


def _item_id(where: str, check, text: str) -> str:
    short = text if len(text) <= 70 else text[:67] + "..."
    return f"{where} [{check.label}] {short}"


def _command_items():
    items = []
    for command in COMMANDS:
        check = CHECKS.get(command.text)
        if check is not None:
            items.append(pytest.param(command, check, id=_item_id(command.where, check, command.text)))
    return items


def _program_items():
    items = []
    for block in PROGRAM_BLOCKS:
        key = _program_key(block)
        if key is not None:
            where = f"{block.document}:{block.line}"
            items.append(pytest.param(block, PROGRAMS[key], id=_item_id(where, PROGRAMS[key], f"python: {key}")))
    return items


# -- running the documentation --------------------------------------------------------------------
class Documentation:
    """The documentation run once against one head and one temp store: each item after what it
    names in ``after``, up to ``SIDE_BY_SIDE`` at once (plus ``CONTINUATION_ROOM`` for items that
    follow one already run), continuations of a started story first."""

    def __init__(self, head, home: Path, ports: dict[int, int]) -> None:
        self.head = head
        self.home = home
        self.ports = ports
        self.outcomes: dict[str, Outcome] = {}  # command text (or program key) -> what it did
        self.services: list[Service] = []
        self.exported: dict[str, str] = {}  # what `export NAME=$(...)` lines set, for the commands after them
        self._lock = threading.Lock()

    def live(self, text: str) -> str:
        """``text`` with the documented ports mapped to this run's."""
        for shown, live in self.ports.items():
            text = re.sub(rf"(?:(?<=:)|(?<=port )|(?<=port=)){shown}\b", str(live), text)
        return text

    def env(self, *, embedded: bool = False, run_id: str | None = None) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH", "OPENAI_", "ANTHROPIC_"))
               and key not in ("OPGRAPH_DEFAULT_MODEL", "OPGRAPH_DURABLE", "VIRTUAL_ENV")}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env.update(OPGRAPH_HOME=str(self.home), OPGRAPH_DB=str(self.home / "opgraph.db"))
        if embedded:
            env["RAY_AUTH_MODE"] = "disabled"  # as the test suite's own embedded Ray runs
        else:
            env.update(RAY_ADDRESS=self.head.address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.head.token,
                       # No warm spare executor per command: it changes no output, and saves a process
                       # for each of the many short runtimes these commands start on one small head.
                       OPGRAPH_STANDBY_EXECUTOR="0")
        env.update(self.exported)
        if run_id is not None:
            env["RUN_ID"] = run_id
        return env

    def run_all(self, items: list[tuple[str, str, object]]) -> None:
        """Run ``(key, command, check)`` items: each once its ``after`` items are done, side by side."""
        names = {check.name: key for key, _, check in items if getattr(check, "name", None)}
        waiting = list(items)
        running: dict[Future, str] = {}
        done: set[str] = set()
        with ThreadPoolExecutor(SIDE_BY_SIDE + CONTINUATION_ROOM) as pool:
            while waiting or running:
                ready = [item for item in waiting if all(names[name] in done for name in getattr(item[2], "after", ()))]
                ready.sort(key=_priority)
                for item in ready:
                    # A story already begun may take one of CONTINUATION_ROOM extra places: what it
                    # follows may be live only for a while (a run that `run watch` must still find).
                    room = SIDE_BY_SIDE + (CONTINUATION_ROOM if _priority(item) == 0 else 0)
                    if len(running) >= room:
                        continue
                    waiting.remove(item)
                    running[pool.submit(self.run, *item, names)] = item[0]
                if not running:  # nothing can start: an ``after`` names what never ran
                    for key, _, check in waiting:
                        self.outcomes[key] = Outcome(None, "", 0.0, f"waits for {check.after}, which never ran")
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()
                    done.add(running.pop(future))

    def run(self, key: str, command: str, check, names: dict[str, str]) -> None:
        captured = [self.outcomes[names[name]].captured for name in getattr(check, "after", ())]
        run_id = next((value for value in captured if value), None)
        if isinstance(check, Run):
            outcome = self._run(command, check, run_id)
        elif isinstance(check, Serve):
            outcome = self._serve(command, check)
        elif isinstance(check, Environment):
            outcome = self._export(command)
        elif isinstance(check, Export):
            outcome = self._export_output(command, check)
        else:
            outcome = self._compare_with_head(command)
        with self._lock:
            self.outcomes[key] = outcome

    def _run(self, command: str, check: Run, run_id: str | None) -> Outcome:
        live, env = self.live(command), self.env(embedded=check.embedded, run_id=run_id)
        deadline = time.monotonic() + (POLL_DEADLINE if check.poll else 0)
        while True:
            outcome = run_shell(live, env, check.timeout)
            if not check.poll or re.search(check.expect, outcome.output) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if check.capture:
            found = re.search(check.capture, outcome.output)
            if found:
                outcome.captured = found.group(1)
            else:
                outcome.notes.append(f"nothing matched {check.capture!r}, so RUN_ID is not known")
        return outcome

    def _serve(self, command: str, check: Serve) -> Outcome:
        started = time.monotonic()
        with self._lock:
            service = Service(self.live(command), self.env(), self.home / f"service-{len(self.services)}.log")
            self.services.append(service)
        problem = service.wait_until_answering(self.live(check.ready), check.timeout)
        return Outcome(0 if problem is None else None, service.output(), time.monotonic() - started, problem)

    def _export(self, command: str) -> Outcome:
        """An ``export`` line: the variable must already be set so for every command run on the head."""
        assignment = command.removeprefix("export ").strip()
        name, _, value = assignment.partition("=")
        if not name.isidentifier() or not value or command == assignment:
            return Outcome(None, "", 0.0, f"not an `export NAME=VALUE` line: {command!r}")
        given = self.env().get(name)
        problem = None if given == " ".join(shlex.split(value)) else f"the head's commands run with {name}={given!r}"
        return Outcome(0 if problem is None else None, f"{name}={given}", 0.0, problem)

    def _export_output(self, command: str, check: Export) -> Outcome:
        """``export NAME=$(COMMAND)``: run COMMAND as a reader's shell would; NAME holds what it printed."""
        name, _, value = command.removeprefix("export ").partition("=")
        if not (value.startswith("$(") and value.endswith(")")):
            return Outcome(None, "", 0.0, f"not an `export NAME=$(COMMAND)` line: {command!r}")
        outcome = run_shell(self.live(value[2:-1]), self.env(), 60.0)
        printed = outcome.output.strip()
        if outcome.status == 0 and re.fullmatch(check.expect, printed):
            with self._lock:
                self.exported[name] = printed
        else:
            outcome.problem = outcome.problem or f"printed {printed[:80]!r}, not {check.expect!r}"
        return outcome

    def _compare_with_head(self, command: str) -> Outcome:
        shown = shlex.split(self.live(command))
        started = [str(argument) for argument in self.head.process.args]
        missing = [token for token in shown[1:] if token not in started]
        problem = f"the head was started without {missing}" if shown[0] != "ray" or missing else None
        return Outcome(0 if problem is None else None, " ".join(started), 0.0, problem)

    def summary(self) -> str:
        lines = [f"{outcome.seconds:7.1f} s  exit {outcome.status}  {key[:90]}"
                 for key, outcome in self.outcomes.items()]
        return "\n".join(["the documentation's commands and programs:", *lines])

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def _priority(item: tuple[str, str, object]) -> int:
    """Stories already begun first; then long waits; then items that begin a story; then the rest.
    ``sort`` is stable, so each group keeps document order."""
    check = item[2]
    if getattr(check, "after", ()):
        return 0
    if getattr(check, "early", False):
        return 1
    return 2 if getattr(check, "name", None) else 3


def _documented_items(home: Path) -> list[tuple[str, str, object]]:
    """Every item the module runs, in document order, each once: (key, command to run, check)."""
    items: dict[str, tuple[str, str, object]] = {}
    for path in documents():
        name = str(path.relative_to(REPOSITORY))
        for block in [b for b in BLOCKS if b.document == name]:
            if block.tag in COMMAND_BLOCKS:
                for command in read_commands(block):
                    check = CHECKS.get(command.text)
                    if isinstance(check, AfterInstall):
                        installed = command.text.removeprefix(f"{check.install} && ")
                        items.setdefault(command.text, (command.text, installed, check.then))
                    elif isinstance(check, (Run, Serve, Environment, Export, HeadFixture)):
                        items.setdefault(command.text, (command.text, command.text, check))
            elif block.tag == "python" and (key := _program_key(block)):
                script = home / f"program-{block.line}.py"
                script.write_text(block.text)
                items.setdefault(key, (key, f"python {shlex.quote(str(script))}", PROGRAMS[key]))
    return list(items.values())


@pytest.fixture(scope="module")
def documentation(local_head_starter):
    """Runs every documented command and program once; yields what each did."""
    home = Path(tempfile.mkdtemp(prefix="opgraph-docs-"))
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            # The head's processes (and the job drivers it starts) use the same store as the commands.
            patch.setenv("OPGRAPH_HOME", str(home))
            patch.setenv("OPGRAPH_DB", str(home / "opgraph.db"))
            head = stack.enter_context(local_head_starter())  # stopped (and checked) when the stack closes
        stack.callback(shutil.rmtree, home, ignore_errors=True)
        ports = {8000: free_port(), 9464: free_port(), 6379: head.gcs_port, 8265: head.dashboard_port}
        run = Documentation(head, home, ports)
        stack.callback(run.stop)
        started = time.monotonic()
        run.run_all(_documented_items(home))
        print(run.summary(), f"\n{time.monotonic() - started:7.1f} s wall time")  # shown with -s
        yield run


def _assert_outcome(outcome: Outcome, check, what: str) -> None:
    tail = outcome.output[-3000:]
    assert outcome.problem is None, f"{what}: {outcome.problem}\n{tail}"
    if isinstance(check, Run):
        assert outcome.status == check.exit, f"{what}: exit {outcome.status}, not {check.exit}\n{tail}"
        assert re.search(check.expect, outcome.output), f"{what}: no {check.expect!r} in its output\n{tail}"
    assert not outcome.notes, f"{what}: {outcome.notes}\n{tail}"


# -- each documented item ---------------------------------------------------------------------------
@pytest.mark.timeout(DOCUMENTATION_DEADLINE)
@pytest.mark.parametrize(("command", "check"), _command_items())
def test_documented_command(command, check, request):
    """One command as the docs show it: run (or served, exported, compared) in the module's pass,
    or, when it cannot run here, parsed."""
    if isinstance(check, NotRun):
        assert check.reason
        return
    if isinstance(check, ParsedOnly):
        _assert_parses(command.text, request.getfixturevalue("parsed_help")[command.text])
        return
    if isinstance(check, AfterInstall):
        assert command.text.startswith(f"{check.install} && "), command.text
        check = check.then
    documentation = request.getfixturevalue("documentation")
    _assert_outcome(documentation.outcomes[command.text], check, f"`{command.text}` ({command.where})")


@pytest.fixture(scope="module")
def parsed_help():
    """Every parsed-only command's ``--help``, from one interpreter: command text -> (status, output)."""
    commands = [text for text, check in CHECKS.items() if isinstance(check, ParsedOnly)]
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    return dict(zip(commands, help_of(commands, env), strict=True))


def _assert_parses(text: str, parsed: tuple[int | None, str]) -> None:
    """``text --help`` exits 0 (every value shown parses), and lists every option ``text`` uses."""
    status, output = parsed
    assert status == 0, f"`{text} --help` exited {status}:\n{output[-2000:]}"
    options = {token.split("=")[0] for token in shlex.split(text) if token.startswith("--")}
    unknown = sorted(option for option in options if option not in output)
    assert not unknown, f"`{text}` uses options its --help does not list: {unknown}"


@pytest.mark.timeout(DOCUMENTATION_DEADLINE)
@pytest.mark.parametrize(("block", "check"), _program_items())
def test_documented_program(block, check, request):
    """One complete Python program (a `python` block), run as a script in a subprocess."""
    documentation = request.getfixturevalue("documentation")
    _assert_outcome(documentation.outcomes[_program_key(block)], check, f"the program at {block.document}:{block.line}")


# -- the docs and this module agree -----------------------------------------------------------------
def test_the_documentation_reads_cleanly():
    """Every fence is closed and tagged with a kind the tests read; command blocks hold only commands."""
    unknown = [f"{block.document}:{block.line} ```{block.tag}" for block in BLOCKS if block.tag not in BLOCK_KINDS]
    assert not READ_PROBLEMS and not unknown, READ_PROBLEMS + unknown


def test_every_documented_command_and_program_has_a_check():
    """A new command or program in the docs cannot slip through: it needs a check here."""
    unchecked = sorted({f"{command.where}: {command.text}" for command in COMMANDS if command.text not in CHECKS})
    unmatched = [f"{block.document}:{block.line}" for block in PROGRAM_BLOCKS if _program_key(block) is None]
    assert not unchecked and not unmatched, (
        f"documented but not checked (add them to CHECKS or PROGRAMS): {unchecked + unmatched}")


def test_every_check_is_for_something_the_docs_still_show():
    shown = {command.text for command in COMMANDS}
    stale = sorted(set(CHECKS) - shown)
    unused = sorted(key for key in PROGRAMS if not any(key in block.text for block in PROGRAM_BLOCKS))
    assert not stale and not unused, f"checks for what the docs no longer show: {stale + unused}"


def _signature_blocks():
    """``py`` blocks that show real signatures: one class of opgraph.actors, holding only ``...`` methods."""
    import opgraph.actors

    for block in BLOCKS:
        if block.tag != "py":
            continue
        tree = ast.parse(block.text)
        if (len(tree.body) == 1 and isinstance(tree.body[0], ast.ClassDef)
                and tree.body[0].name in opgraph.actors.__all__):
            yield block, getattr(opgraph.actors, tree.body[0].name), tree.body[0]


def _shown_parameters(function) -> list[tuple[str, object]]:
    arguments = function.args
    shown = [(a.arg, None) for a in arguments.args]
    shown += [(a.arg, ast.literal_eval(d)) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)]
    return shown


def test_fragments_parse_and_playbooks_load(tmp_path):
    """``py`` fragments compile (top-level await allowed); every ``yaml`` block is a playbook that loads."""
    from opgraph.cluster.lanes.play.playbook import load_playbook

    for block in BLOCKS:
        where = f"{block.document}:{block.line}"
        if block.tag == "py":
            compile(block.text, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        elif block.tag == "yaml":
            path = tmp_path / f"shown-{block.line}.playbook.yaml"
            path.write_text(block.text)
            assert load_playbook(path).args, f"{where}: a playbook with no args"


def test_signatures_shown_are_the_real_ones():
    """A signature block (``class Session:`` with ``...`` methods) matches the code: every shown
    method's parameters, in order, with their defaults; the README shows Session.flow's."""
    checked = []
    for block, real_class, shown_class in _signature_blocks():
        for function in shown_class.body:
            assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{block.document}:{block.line}"
            real = [(name, None if p.default is inspect.Parameter.empty else p.default)
                    for name, p in inspect.signature(getattr(real_class, function.name)).parameters.items()]
            assert _shown_parameters(function) == real, f"{block.document}:{block.line} {function.name}"
            checked.append((block.document, f"{shown_class.name}.{function.name}"))
    assert ("README.md", "Session.flow") in checked


def test_the_readme_is_a_front_door():
    """At most 300 lines, the two commands as CI knows them, and no design-record numbers anywhere."""
    readme = (REPOSITORY / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for path in documents():
        text = path.read_text()
        assert not re.search(r"\bADR-?\d", text), f"{path.name} cites a design record by number"
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text):
            assert (path.parent / target).is_file(), f"{path.name} links to {target}, which does not exist"


def test_the_readme_commands_are_what_ci_runs():
    """The README's two commands: its install is the one `.ci/run` makes (and its extras exist, the
    local one built with the flags opgraph names), and its test command is the one `.ci/run` ends with."""
    from opgraph.actors.providers.local import BUILD_FLAGS

    commands = [command.text for command in COMMANDS if command.document == "README.md"]
    assert commands[:2] == [f"{INSTALL} && opgraph demo", "python -m pytest -q"]
    assert LOCAL_BUILD == f'CMAKE_ARGS="{BUILD_FLAGS}"'
    ci = (REPOSITORY / ".ci" / "run").read_text()
    assert "exec python -m pytest -q" in ci and "pip install -e '.[test]'" in ci and "fetch local-model" in ci
    project = (REPOSITORY / "pyproject.toml").read_text()
    assert re.search(r"^test = \[", project, re.MULTILINE) and re.search(r"^local = \[", project, re.MULTILINE)


def test_the_exit_code_table_is_the_one_the_commands_use():
    """docs/cli.md's table is ExitCode's, row for row, so the two cannot drift apart."""
    from opgraph.cluster.command_line import ExitCode

    text = (REPOSITORY / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+) \|$", text, re.MULTILINE)
    assert rows == [(str(code.value), code.name, code.meaning) for code in ExitCode]
