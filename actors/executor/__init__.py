"""The GraphExecutor actor: one authoritative scheduler per run, and what it needs around it.

Owns the actor's remote surface (``actor``), its data path from instructions to calls and
back (``shell``), the durable run log's append and flush (``durability``) and the bounded
event queues of other clients watching a run (``watchers``).
"""

__all__ = ["actor", "durability", "shell", "watchers"]
