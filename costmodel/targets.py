"""Execution targets: what each training framework cannot run and how it lays out model states.

One file per target in ``profiles/targets/<name>.toml`` (autopar, megatron, torchtitan, deepspeed), every rule
and byte count with its source. ``load_target(name)`` reads one into a frozen ``Target``:

- ``Target.refusals(config, experts=, tied_embeddings=, glu=)``: why the target cannot run a
  ``ParallelConfig``, one message per rule, each naming the numbers and the fix ([[cannot_run]] tables);
- ``Target.memory_mode(config, ...)``: the target's sharding mode for that configuration (the first
  ``[memory.<mode>]`` table whose ``when`` holds);
- ``Target.model_state_bytes(params=, mode=, dp=)``: weights, gradients and optimizer states of ``params``
  parameters under ``mode`` over a data-parallel degree ``dp``: ``replicated + sharded / dp`` bytes each.

A ``when`` table holds facts that must all hold: an exact value, a list of allowed values, or for integer
facts a comparison string (``"> 1"``, ``">= 2"``, ``"< 4"``, ``"<= 1"``, ``"!= 1"``). Files are read once per
process (an ``lru_cache`` of immutable results, as ``costmodel.profiles`` does).
"""

from __future__ import annotations

import functools
import operator
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from costmodel.errors import ProfileError
from costmodel.profiles import PROFILES_DIR
from costmodel.step_config import ParallelConfig

TARGETS_DIR = PROFILES_DIR / "targets"
TARGET_NAMES = ("autopar", "megatron", "torchtitan", "deepspeed")
STATE_TERMS = ("weights", "gradients", "optimizer")

# The facts a rule may test, and their types.
FACTS: dict[str, type] = {
    "tp": int, "pp": int, "dp": int, "cp": int, "ep": int, "zero_stage": int, "virtual_stages": int,
    "microbatch": int, "experts": int, "schedule": str, "recompute": str, "sequence_parallel": bool,
    "moe": bool, "tied_embeddings": bool, "glu": bool,
}
_COMPARE: dict[str, Callable[[int, int], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt, "<": operator.lt,
}


def config_facts(config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                 glu: bool = True) -> dict[str, Any]:
    """The facts rules test: the configuration's degrees and knobs plus the model's experts, tied embeddings
    and gated MLP (``glu``: SwiGLU, the Llama family, as opposed to a GeLU MLP)."""
    return {
        "tp": config.tp, "pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep,
        "zero_stage": config.zero_stage, "virtual_stages": config.virtual_stages or 1,
        "microbatch": config.microbatch or 0, "schedule": config.schedule, "recompute": config.recompute,
        "sequence_parallel": config.sequence_parallel, "experts": experts, "moe": experts > 0,
        "tied_embeddings": tied_embeddings, "glu": glu,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class Condition:
    """One fact of a ``when`` table: ``fact`` equal to / in ``values``, or compared with ``op`` ``values[0]``."""

    fact: str
    values: tuple[Any, ...]
    op: str = "in"

    def holds(self, facts: dict[str, Any]) -> bool:
        value = facts[self.fact]
        if self.op == "in":
            return value in self.values
        return _COMPARE[self.op](value, self.values[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """Something the target cannot run: when ``when`` holds, ``message`` and ``fix`` (facts in braces)."""

    when: tuple[Condition, ...]
    message: str
    fix: str
    source: str

    def applies(self, facts: dict[str, Any]) -> bool:
        return all(c.holds(facts) for c in self.when)

    def text(self, facts: dict[str, Any]) -> str:
        return f"{self.message.format(**facts)}: {self.fix.format(**facts)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTerm:
    """Bytes per parameter of one model-state term: ``replicated + sharded / d``."""

    replicated: float = 0.0
    sharded: float = 0.0

    def bytes_per_param(self, dp: int) -> float:
        return self.replicated + self.sharded / dp


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryMode:
    """One sharding mode of the target and its model-state layout."""

    name: str
    when: tuple[Condition, ...]
    description: str
    weights: StateTerm
    gradients: StateTerm
    optimizer: StateTerm
    source: str

    def bytes_per_param(self, dp: int) -> float:
        return sum(getattr(self, t).bytes_per_param(dp) for t in STATE_TERMS)

    def formula(self) -> str:
        """``6 + 12/d`` style: the replicated and the sharded bytes per parameter summed over the terms."""
        rep = sum(getattr(self, t).replicated for t in STATE_TERMS)
        sh = sum(getattr(self, t).sharded for t in STATE_TERMS)
        parts = ([f"{rep:g}"] if rep else []) + ([f"{sh:g}/d"] if sh else [])
        return " + ".join(parts) or "0"


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """An execution target read from ``profiles/targets/<name>.toml``."""

    name: str
    framework: str
    source: str
    cannot_run: tuple[Rule, ...]
    modes: tuple[MemoryMode, ...]

    def refusals(self, config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                 glu: bool = True) -> list[str]:
        """Why this target cannot run ``config`` (empty: it can), each naming the numbers and the fix."""
        facts = config_facts(config, experts=experts, tied_embeddings=tied_embeddings, glu=glu)
        return [r.text(facts) for r in self.cannot_run if r.applies(facts)]

    def memory_mode(self, config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                    glu: bool = True) -> MemoryMode:
        """The first mode whose ``when`` holds for ``config`` (ProfileError when none does)."""
        facts = config_facts(config, experts=experts, tied_embeddings=tied_embeddings, glu=glu)
        for mode in self.modes:
            if all(c.holds(facts) for c in mode.when):
                return mode
        raise ProfileError(f"target {self.name}: no [memory.*] mode holds for {config.summary()}; "
                           f"modes: {', '.join(m.name for m in self.modes)}")

    def mode(self, name: str) -> MemoryMode:
        for m in self.modes:
            if m.name == name:
                return m
        raise ProfileError(f"target {self.name} has no memory mode {name!r}; modes: "
                           f"{', '.join(m.name for m in self.modes)}")

    def model_state_bytes(self, *, params: float, mode: str, dp: int) -> dict[str, float]:
        """Bytes of weights, gradients and optimizer states of ``params`` parameters under ``mode``, sharded
        over a data-parallel degree ``dp``."""
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ProfileError(f"dp={dp!r} must be a positive integer")
        if params < 0:
            raise ProfileError(f"params={params!r} must be >= 0")
        m = self.mode(mode)
        return {t: params * getattr(m, t).bytes_per_param(dp) for t in STATE_TERMS}


def load_target(name: str, *, directory: str | Path | None = None) -> Target:
    """Read ``<directory or profiles/targets>/<name>.toml``; ProfileError naming the file and key if malformed."""
    root = Path(directory) if directory else TARGETS_DIR
    path = root / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.toml")) if root.is_dir() else []
        raise ProfileError(f"unknown execution target {name!r}: no {path}; known targets: {', '.join(known)}")
    return _load(str(path))


@functools.lru_cache(maxsize=16)
def _load(path: str) -> Target:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: invalid TOML: {e}") from None
    # other top-level sections (kernel efficiencies, overlaps) are read by their own readers
    rules = data.get("cannot_run", [])
    if not isinstance(rules, list):
        raise ProfileError(f"{path}: cannot_run must be an array of tables ([[cannot_run]])")
    memory = data.get("memory", {})
    if not isinstance(memory, dict) or not memory:
        raise ProfileError(f"{path}: needs at least one [memory.<mode>] table")
    return Target(
        name=_string(data, "name", path, "top level"),
        framework=_string(data, "framework", path, "top level"),
        source=_string(data, "source", path, "top level"),
        cannot_run=tuple(_rule(r, path, f"cannot_run[{i}]") for i, r in enumerate(rules)),
        modes=tuple(_mode(n, m, path) for n, m in memory.items()),
    )


def _rule(data: Any, path: str, where: str) -> Rule:
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: [{where}] must be a table")
    _check_keys(data, ("when", "message", "fix", "source"), path, where)
    rule = Rule(when=_when(data.get("when"), path, where), message=_string(data, "message", path, where),
                fix=_string(data, "fix", path, where), source=_string(data, "source", path, where))
    sample = {k: t() for k, t in FACTS.items()}
    try:
        rule.text(sample)
    except (KeyError, IndexError, ValueError) as e:
        raise ProfileError(f"{path}: [{where}] message or fix names an unknown fact {e}; facts: "
                           f"{', '.join(FACTS)}") from None
    return rule


def _mode(name: str, data: Any, path: str) -> MemoryMode:
    where = f"memory.{name}"
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: [{where}] must be a table")
    _check_keys(data, ("when", "description", "source", *STATE_TERMS), path, where)
    terms = {t: _term(data.get(t, {}), path, f"{where}.{t}") for t in STATE_TERMS}
    return MemoryMode(name=name, when=_when(data.get("when", {}), path, where),
                      description=_string(data, "description", path, where),
                      source=_string(data, "source", path, where), **terms)


def _term(data: Any, path: str, where: str) -> StateTerm:
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: [{where}] must be an inline table {{ replicated = .., sharded = .. }}")
    _check_keys(data, ("replicated", "sharded"), path, where)
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{path}: [{where}] {key} = {value!r} must be a number >= 0 (bytes per parameter)")
    return StateTerm(replicated=float(data.get("replicated", 0.0)), sharded=float(data.get("sharded", 0.0)))


def _when(data: Any, path: str, where: str) -> tuple[Condition, ...]:
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: [{where}] `when` must be an inline table of facts")
    return tuple(_condition(fact, value, path, where) for fact, value in data.items())


def _condition(fact: str, value: Any, path: str, where: str) -> Condition:
    if fact not in FACTS:
        raise ProfileError(f"{path}: [{where}] unknown fact {fact!r}; facts: {', '.join(FACTS)}")
    kind = FACTS[fact]
    if kind is int and isinstance(value, str):
        op = next((o for o in _COMPARE if value.strip().startswith(o)), None)
        number = value.strip()[len(op):].strip() if op else ""
        if op is None or not number.lstrip("-").isdigit():
            raise ProfileError(f"{path}: [{where}] {fact} = {value!r}: write an integer, a list, or a comparison "
                               f"such as '> 1' ({', '.join(_COMPARE)})")
        return Condition(fact=fact, values=(int(number),), op=op)
    values = tuple(value) if isinstance(value, list) else (value,)
    for v in values:
        if type(v) is not kind:
            raise ProfileError(f"{path}: [{where}] {fact} = {value!r} must be {kind.__name__} (or a list of them)")
    return Condition(fact=fact, values=values)


def _string(data: dict, key: str, path: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{path}: [{where}] needs a non-empty string {key!r}")
    return value


def _check_keys(data: dict, allowed: tuple[str, ...], path: str, where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ProfileError(f"{path}: [{where}] unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
