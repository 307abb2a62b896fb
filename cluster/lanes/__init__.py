"""The lanes (ADR-0068): how a graph is defined, whether a planner may touch it, whether it may grow.

Owns the lane adapter protocol and registry, the capability matrix and run provenance;
each lane's own parts (the fixed workflow lane's spec and compiler) live in its sub-package.
"""

__all__: list[str] = []
