"""Export a plan as the settings of another training framework, refusing what that framework cannot run.

``export_plan(plan, target)`` returns an ``ExportResult``: a ``pretrain_gpt.py`` command line (Megatron-LM), a
config-registry module that torchtitan 0.3.0's ``ConfigManager`` loads, or a DeepSpeed JSON config (writers in
``planner.export_writers``), plus what runs differently there than planned. Before writing anything it checks
the plan against the target's constants file (``profiles/targets/<target>.toml``, ``planner.export_check``):

1. what the target cannot run: ConfigError naming the numbers and the fix;
2. memory under the target's model-state layout with the plan's other memory as recorded (until plans are
   priced per target): InfeasiblePlanError over a device's memory, a warning within ``CLOSE_FRACTION`` of it.

``force=True`` returns the settings with the refusals listed instead of raising. Model dimensions come from
the plan's model spec (``planner.models.model_dims``) unless ``dims`` is given (user-code models).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.errors import ConfigError, InfeasiblePlanError
from costmodel.targets import load_target
from planner.export_check import (  # layers_per_stage: used by planner.diff
    GB,
    MemoryCheck,
    check_memory,
    layers_per_stage,
    memory_refusal,
    plan_dims,
    target_refusals,
)
from planner.export_writers import WRITERS
from planner.models import ModelDims
from planner.plan import Plan

TARGETS = ("megatron", "torchtitan", "deepspeed")
__all__ = ["TARGETS", "ExportResult", "export_plan", "layers_per_stage"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    target: str
    text: str
    """The settings, ready to save as ``filename``."""
    filename: str
    notes: tuple[str, ...] = ()
    """What runs differently in the target than the plan priced (it still starts)."""
    warnings: tuple[str, ...] = ()
    """Memory close to the device's capacity under the target's layout."""
    refusals: tuple[str, ...] = ()
    """What the target cannot run (only with ``force=True``; otherwise export_plan raises)."""
    memory: MemoryCheck | None = None


def export_plan(plan: Plan, target: str, *, dims: ModelDims | None = None, force: bool = False) -> ExportResult:
    """The settings of ``target`` (one of ``TARGETS``) that run ``plan``; see the module docstring."""
    if target not in TARGETS:
        raise ConfigError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    dims = dims or plan_dims(plan)
    spec = load_target(target)
    refusals = target_refusals(plan, spec, dims)
    memory = check_memory(plan, spec, dims)
    if memory.worst.status == "exceeds":
        refusals.append(memory_refusal(plan, spec, dims, memory))
    if refusals and not force:
        worst = memory.worst.target_bytes / GB
        error = InfeasiblePlanError if memory.worst.status == "exceeds" else ConfigError
        kwargs = {"memory_gb_needed": worst} if error is InfeasiblePlanError else {}
        raise error(f"{target} cannot run this plan as planned:\n- " + "\n- ".join(refusals), **kwargs)
    warnings = tuple(f"{target}: {r.line()}" for r in memory.ranks if r.status == "close")
    text, filename, notes = WRITERS[target](plan, dims, memory)
    return ExportResult(target=target, text=text, filename=filename, notes=tuple(notes), warnings=warnings,
                        refusals=tuple(refusals), memory=memory)
