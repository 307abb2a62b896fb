"""The caller's side of the runtime: the Session facade, live run control and the Runtime it joins.

Owns what runs in the caller's process (a script, a job driver, the HTTP server): nothing
here schedules a node or makes a model call; it ships graphs to an executor and follows them.
"""

__all__ = ["control", "feed", "runtime", "session"]
