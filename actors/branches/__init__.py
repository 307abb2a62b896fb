"""Conversation branches: the copy-on-write table, the BranchStore actor and the executor's registry.

Owns branch state (``store``: ``BranchTable`` and the ``BranchStore`` actor that hosts many
branches) and where each branch lives and who owns it (``registry``).
"""

__all__ = ["registry", "store"]
