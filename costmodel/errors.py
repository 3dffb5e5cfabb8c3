"""Typed exceptions for all of autopar.

They live in the lowest package (costmodel) so that every layer can raise and import them from here.
Each message names the offending value and the fix.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error autopar raises on purpose (bad input, infeasible request)."""


class ProfileError(AutoparError):
    """A hardware / cluster / calibration profile is malformed or unknown."""


class InfeasiblePlanError(AutoparError):
    """No plan (or the requested configuration) fits the cluster; the message says what would.

    ``memory_gb_needed`` is the memory per device the leanest candidate needs, when it is known.
    """

    def __init__(self, message: str, *, memory_gb_needed: float | None = None) -> None:
        super().__init__(message)
        self.memory_gb_needed = memory_gb_needed


class UnsupportedModelError(AutoparError):
    """The model cannot be traced or contains ops autopar has no rule for."""


class PlanMismatchError(AutoparError):
    """A plan file does not belong to this model / world size, or is malformed."""


class ConfigError(AutoparError):
    """A parallel configuration is invalid (degrees do not divide, batch not divisible, ...)."""


class RankFailureError(AutoparError):
    """Another rank of a distributed run died or hung: the message names the rank(s) and the training step."""
