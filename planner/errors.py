"""Re-export of autopar's typed exceptions (defined in ``costmodel.errors``, the lowest layer)."""

from costmodel.errors import (  # noqa: F401
    AutoparError,
    ConfigError,
    InfeasiblePlanError,
    PlanMismatchError,
    ProfileError,
    UnsupportedModelError,
)
