"""The server's default bounds, in a module that loads nothing: `opgraph serve`'s parser shows them
in its --help without loading uvicorn, FastAPI or Ray. Each is enforced where it is used
(deadlines.py, runs.py); body.py keeps its own (it is as light)."""

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_HEAD_TIMEOUT", "DEFAULT_MAX_RUNS"]

DEFAULT_HEAD_TIMEOUT = 5.0  # seconds for a request line and headers (a browser sends them in one packet)
DEFAULT_BODY_TIMEOUT = 10.0  # seconds for a body once the head is in (4 MiB, the default limit, at 3.3 Mbit/s)
# Runs one server admits at once (`opgraph serve --max-runs`, OPGRAPH_MAX_RUNS): each holds a
# Session flow, store writes and its executor's capacity; 60 admitted at once took 120 s to drain.
DEFAULT_MAX_RUNS = 16
