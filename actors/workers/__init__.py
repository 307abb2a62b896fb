"""The operation workers and the supervision of the executor's actor pools.

Owns the ``OperationWorker`` actor (``worker``), the direct call channel between an
executor and a worker (``channel``), single turns outside a graph (``turns``), per-call
token tallies (``usage``) and the pools that notice and replace dead actors (``supervision``).
"""

__all__ = ["channel", "supervision", "turns", "usage", "worker"]
