"""opgraph.engines: Engine/EngineRun and the domain engines (ADR-0034), run through a Session.

Owns the engine core (hard budgets, typed emissions with bounded repair, the advisory
judge, EngineResult, run_dag) and the domain engines: planning, review, research, hypothesis
and coding (coding with its workspace sandbox: a copy on a worker, confined writes, gates,
an offered patch). An engine never has a scheduler of its own: agent turns run on
OperationWorkers, and a DAG goes to ``Session.flow``. Imports kernel/ and actors/ only;
cluster/ supplies the durable sink.
"""

from .agents import Agent, emission_bundle, emission_key, repair_instruction, role_profile
from .budget import BUDGET_REASONS, DEFAULT_PRICES, BudgetLimits, ModelPrice, PriceTable, RunBudget
from .coding import (
    ChangeProposed,
    CodeResultRecorded,
    CodingEngine,
    CodingRun,
    CodingSpec,
    TestsRan,
    WorkPlanned,
)
from .engine import PARTIAL_EXPORT_TIMEOUT_S, Engine
from .errors import (
    EngineBudgetError,
    EngineError,
    EngineInputError,
    EventSinkError,
    PlanError,
    WorkspaceConflictError,
)
from .events import (
    DEFAULT_MAX_RETAINED_EVENTS,
    DEFAULT_MAX_RETAINED_NOTIFICATIONS,
    EngineEvent,
    EventLog,
    EventRecord,
    EventSink,
    JudgeVerdict,
    MemorySink,
)
from .hypothesis import (
    ApplicationMapped,
    ChainEvent,
    ConclusionDrawn,
    EvidenceCollected,
    ExperimentDesigned,
    FindingPosted,
    HypothesisEngine,
    HypothesisFormed,
    HypothesisRun,
    QuestionRaised,
    ResultRecorded,
)
from .kinds import ENGINE_KINDS, engine_for
from .planning import PlanningEngine, PlanProposed, TaskSettled
from .port import AgentPort, SessionPort
from .research import ContradictionFound, DepthRequested, FindingEmitted, ResearchEngine, ResearchRun
from .result import DEGRADE_REASONS, EngineResult
from .review import DimensionReviewed, IssueFound, ReviewEngine, ReviewRun, ReviewVerdict, VerifyResult
from .run import EngineRun, EventCallback
from .statistics import engine_statistics, reset_engine_statistics
from .workspace import FileChange, FileEdit, Sandbox, apply_changes

__all__ = [
    "BUDGET_REASONS",
    "DEFAULT_MAX_RETAINED_EVENTS",
    "DEFAULT_MAX_RETAINED_NOTIFICATIONS",
    "DEFAULT_PRICES",
    "DEGRADE_REASONS",
    "ENGINE_KINDS",
    "PARTIAL_EXPORT_TIMEOUT_S",
    "Agent",
    "AgentPort",
    "ApplicationMapped",
    "BudgetLimits",
    "ChainEvent",
    "ChangeProposed",
    "CodeResultRecorded",
    "CodingEngine",
    "CodingRun",
    "CodingSpec",
    "ConclusionDrawn",
    "ContradictionFound",
    "DepthRequested",
    "DimensionReviewed",
    "Engine",
    "EngineBudgetError",
    "EngineError",
    "EngineEvent",
    "EngineInputError",
    "EngineResult",
    "EngineRun",
    "EventCallback",
    "EventLog",
    "EventRecord",
    "EventSink",
    "EventSinkError",
    "EvidenceCollected",
    "ExperimentDesigned",
    "FileChange",
    "FileEdit",
    "FindingEmitted",
    "FindingPosted",
    "HypothesisEngine",
    "HypothesisFormed",
    "HypothesisRun",
    "IssueFound",
    "JudgeVerdict",
    "MemorySink",
    "ModelPrice",
    "PlanError",
    "PlanProposed",
    "PlanningEngine",
    "PriceTable",
    "QuestionRaised",
    "ResearchEngine",
    "ResearchRun",
    "ResultRecorded",
    "ReviewEngine",
    "ReviewRun",
    "ReviewVerdict",
    "RunBudget",
    "Sandbox",
    "SessionPort",
    "TaskSettled",
    "TestsRan",
    "VerifyResult",
    "WorkPlanned",
    "WorkspaceConflictError",
    "apply_changes",
    "emission_bundle",
    "emission_key",
    "engine_for",
    "engine_statistics",
    "repair_instruction",
    "reset_engine_statistics",
    "role_profile",
]
