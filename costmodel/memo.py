"""Memoization keys for the cost model's pure functions (``functools.lru_cache``)."""

from __future__ import annotations


class ByIdentity:
    """Hash an immutable object (a Cluster, a Workload) by identity.

    The memo that holds the key keeps the object alive, so its id stays unique while the entry exists.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj
