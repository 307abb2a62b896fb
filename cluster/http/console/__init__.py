"""The run console in the browser (`opgraph serve`): the runs list, a run's live graph, each node's panel.

Server-rendered pages (Jinja2 templates and a little JavaScript, shipped as package data; no
build step): views.py draws the pages from the run store, graph.py folds and lays out a run's
graph as SVG, live.py streams a live run's changes from the executor's watcher queue.
"""

from .graph import GROUP_MIN, STATES, GraphModel, build_model, render_svg
from .live import TICK, LiveFeeds
from .views import PAGE_SIZE, TRUNCATE_AT, Console

__all__ = ["GROUP_MIN", "PAGE_SIZE", "STATES", "TICK", "TRUNCATE_AT", "Console", "GraphModel", "LiveFeeds",
           "build_model", "render_svg"]
