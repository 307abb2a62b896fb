"""`opgraph o flow ARGS...` in a process of its own, with the scripted planner registered (planned_scripts).

Usage: python planned_owner.py LOG_PATH ARGS... ; exits with the command's status.
"""

from __future__ import annotations

import sys

import planned_scripts
from ray import cloudpickle

from opgraph.actors.providers import ScriptedProvider
from opgraph.cluster.cli.orchestrate import main_flow

if __name__ == "__main__":
    cloudpickle.register_pickle_by_value(planned_scripts)  # its workers need not import this folder
    provider = ScriptedProvider(planned_scripts.PlannedScript(sys.argv[1]))
    sys.exit(main_flow(sys.argv[2:], providers={"scripted": provider}))
