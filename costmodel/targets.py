"""Execution targets: how each training framework runs a step, what it cannot run, how it lays out model states.

One file per target in ``profiles/targets/<name>.toml`` (autopar, megatron, torchtitan, deepspeed), every
constant, rule and byte count with its source. ``load_target("name")`` or ``load_target("name:option")`` reads
one into a frozen ``Target``:

- ``Target.constants``: the step model's ``StepConstants`` ([kernels], [overlap] and [comm] tables, each key
  ``{ value = .., source = ".." }``) with the GEMM precisions it runs ([precision.<name>] tables); an
  ``[options.<name>]`` table overrides some of them for a named way of running the target (``megatron:sc21``:
  Megatron-LM as the SC21 paper ran it). ``estimate_step(..., target=)`` prices with exactly these;

- ``Target.refusals(config, experts=, tied_embeddings=, glu=)``: why the target cannot run a
  ``ParallelConfig``, one message per rule, each naming the numbers and the fix ([[cannot_run]] tables, and a
  precision without a [precision.<name>] table);
- ``Target.memory_mode(config, ..., gpu=)``: the target's sharding mode for that configuration on a GPU or CPU
  rank (the first ``[memory.<mode>]`` table whose ``when`` holds; ``fsdp2 = true`` marks a layout sharded by
  torch FSDP2, whose staging buffers the step model adds);
- ``Target.model_state_bytes(params=, mode=, dp=)``: weights, gradients and optimizer states of ``params``
  parameters under ``mode`` over a data-parallel degree ``dp``: ``replicated + sharded / dp`` bytes each.

A ``when`` table holds facts that must all hold: an exact value, a list of allowed values, or for integer
facts a comparison string (``"> 1"``, ``">= 2"``, ``"< 4"``, ``"<= 1"``, ``"!= 1"``). Files are read once per
process (an ``lru_cache`` of immutable results, as ``costmodel.profiles`` does).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from costmodel.errors import ConfigError, ProfileError
from costmodel.memo import ByIdentity
from costmodel.profiles import PROFILES_DIR
from costmodel.step_config import P2P_BOUNDARIES, PRECISIONS, ParallelConfig, PrecisionConstants, StepConstants

TARGETS_DIR = PROFILES_DIR / "targets"
TARGET_NAMES = ("autopar", "megatron", "torchtitan", "deepspeed")
STATE_TERMS = ("weights", "gradients", "optimizer")

# The facts a rule may test, and their types.
FACTS: dict[str, type] = {
    "tp": int, "pp": int, "dp": int, "cp": int, "ep": int, "zero_stage": int, "virtual_stages": int,
    "microbatch": int, "experts": int, "schedule": str, "recompute": str, "sequence_parallel": bool,
    "moe": bool, "tied_embeddings": bool, "glu": bool, "precision": str, "microbatches": int, "gpu": bool,
}
# Constant tables and the StepConstants fields each holds, with their types.
CONSTANT_TABLES: dict[str, dict[str, type]] = {
    "kernels": {"sustained_compute": float, "tp_fused_input_projections": bool, "fused_memory_bound": bool,
                "selective_recompute": str, "expert_gemm_efficiency": float, "expert_gemm_host_s": float,
                "expert_dispatch_saved": float, "fp8_attention": bool, "softmax_bytes": float,
                "elementwise_replicated_bytes": float, "elementwise_ffn_bytes": float,
                "optimizer_bytes_per_param": float, "loss_bytes_per_logit": float,
                "vocab_parallel_loss_bytes_per_logit": float, "gradients_freed_between_steps": bool},
    "overlap": {"overlap_slowdown": float, "overlap_param_gather": bool, "tp_comm_exposed": float,
                "ep_comm_exposed": float, "last_bucket_bytes": float, "zero3_flat_nic": bool, "zero3_passes_recompute": bool,
                "zero3_collectives_per_layer": int, "zero2_reduce_per_microbatch": bool,
                "zero12_per_unit": bool, "first_bucket_bytes": float},
    "pipeline": {"p2p_boundary": str, "recv_buffers_per_microbatch": bool, "stage_outputs_kept": bool},
    "comm": {"grad_reduce_bytes": float, "param_gather_bytes": float},
}
_CONSTANT_TYPES = {k: t for table in CONSTANT_TABLES.values() for k, t in table.items()}
_PRECISION_KEYS = ("gemm_dtype", "requires", "cast_bytes_per_element", "weight_bytes_per_param",
                   "param_gather_bytes", "megatron_args", "source")
GEMM_DTYPES = ("bf16", "fp8", "fp4")
_COMPARE: dict[str, Callable[[int, int], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, ">": operator.gt, "<": operator.lt,
}


def config_facts(config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                 glu: bool = True, gpu: bool = True) -> dict[str, Any]:
    """The facts rules test: the configuration's degrees and knobs (``microbatches``: per step and data-parallel
    rank, 0 while the micro-batch is not chosen) plus the model's experts, tied embeddings and gated MLP
    (``glu``: SwiGLU, the Llama family, as opposed to a GeLU MLP), and whether the device is a GPU (``gpu``:
    a runtime may lay out memory differently on CPU ranks)."""
    return {
        "microbatches": config.num_microbatches if config.microbatch else 0, "gpu": gpu,
        "tp": config.tp, "pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep,
        "zero_stage": config.zero_stage, "virtual_stages": config.virtual_stages or 1,
        "microbatch": config.microbatch or 0, "schedule": config.schedule, "recompute": config.recompute,
        "sequence_parallel": config.sequence_parallel, "experts": experts, "moe": experts > 0,
        "tied_embeddings": tied_embeddings, "glu": glu, "precision": config.precision,
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
    fsdp2: bool = False
    """Sharded by torch FSDP2 (``fully_shard``): its reduce-scatter staging buffers and, at ZeRO-3, its gathered
    root module and prefetched blocks are held too (``costmodel.step.fsdp_buffer_bytes``)."""
    autocast_weight_copies: float = 0.0
    """Bytes per parameter of the lower-precision weight copies ``torch.autocast`` caches while the step computes
    (fp32 parameters under bf16 autocast: one copy of every weight a matmul reads, kept until the autocast region
    exits), over the rank's whole local parameters outside the token embedding (also where they are sharded
    over dp: the copy of a gathered parameter outlives its reshard). Nonzero also says the rank computes under
    autocast, so its blocks are priced (time, collectives, activation and backward working bytes) over the model
    traced with fp32 parameters under autocast (``costmodel.step._ctx_keys``, ``LayerCtx.autocast``)."""
    gradient_buffer: float = 0.0
    """Bytes per parameter of ``gradients`` held from the forward on (DDP's flat bucket, allocated in the step's
    forward): live before the first backward, when the parameters' own gradients are not yet made."""

    def bytes_per_param(self, dp: int) -> float:
        return sum(getattr(self, t).bytes_per_param(dp) for t in STATE_TERMS)

    def term_bytes_per_param(self, dp: int) -> dict[str, float]:
        """Bytes per parameter of each term (weights, gradients, optimizer) over a data-parallel degree ``dp``."""
        return {t: getattr(self, t).bytes_per_param(dp) for t in STATE_TERMS}

    def formula(self) -> str:
        """``6 + 12/d`` style: the replicated and the sharded bytes per parameter summed over the terms."""
        rep = sum(getattr(self, t).replicated for t in STATE_TERMS)
        sh = sum(getattr(self, t).sharded for t in STATE_TERMS)
        parts = ([f"{rep:g}"] if rep else []) + ([f"{sh:g}/d"] if sh else [])
        return " + ".join(parts) or "0"


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """A named way of running the target (``[options.<name>]``): constants that differ from the file's, and the
    framework flags that turn it on (``megatron_args``: what ``autopar export --to megatron`` adds for a plan
    priced with the option; "" where the target's own command line has none)."""

    name: str
    description: str
    source: str
    constants: tuple[tuple[str, Any], ...]
    megatron_args: str = ""
    cannot_run: tuple[Rule, ...] = ()
    """What the target cannot run with this option on (``[[options.<name>.cannot_run]]``), added to its own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """An execution target read from ``profiles/targets/<name>.toml`` (with ``options`` applied)."""

    name: str
    framework: str
    source: str
    cannot_run: tuple[Rule, ...]
    modes: tuple[MemoryMode, ...]
    constants: StepConstants
    """What the step model prices with (kernels, overlaps, communication dtypes, precisions)."""
    sources: tuple[tuple[str, str], ...] = ()
    """(constant or ``precision.<name>``, source) for every constant in ``constants``."""
    options: tuple[Option, ...] = ()
    """The options the file offers."""
    applied: tuple[str, ...] = ()
    """The options applied to ``constants``."""
    precision_args: tuple[tuple[str, str], ...] = ()
    """(precision, Megatron-LM arguments that select it) for the export."""

    @property
    def spec(self) -> str:
        """``name`` or ``name:option``: what ``load_target`` reads back into this target."""
        return ":".join((self.name, *self.applied))

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.constants.precisions)

    def source_of(self, key: str) -> str:
        return dict(self.sources).get(key, "")

    def refusals(self, config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                 glu: bool = True) -> list[str]:
        """Why this target cannot run ``config`` (empty: it can), each naming the numbers and the fix."""
        facts = config_facts(config, experts=experts, tied_embeddings=tied_embeddings, glu=glu)
        me = ByIdentity(self)
        applying = _applying_rules(me, tuple(facts[f] for f in _tested_facts(me)[1]))
        out = [self.cannot_run[i].text(facts) for i in applying]
        if config.precision not in self.precisions:
            out.append(f"{self.framework} has no {config.precision} training in its constants file (it trains "
                       f"with {', '.join(self.precisions)}): re-plan with --precision "
                       f"{' or '.join(self.precisions)}")
        return out

    def memory_mode(self, config: ParallelConfig, *, experts: int = 0, tied_embeddings: bool = False,
                    glu: bool = True, gpu: bool = True) -> MemoryMode:
        """The first mode whose ``when`` holds for ``config`` on a GPU (``gpu``) or CPU rank (ProfileError when
        none does)."""
        found = self.mode_for(config_facts(config, experts=experts, tied_embeddings=tied_embeddings, glu=glu,
                                           gpu=gpu))
        if found is not None:
            return found
        raise ProfileError(f"target {self.name}: no [memory.*] mode holds for {config.summary()}; "
                           f"modes: {', '.join(m.name for m in self.modes)}")

    def mode_facts(self) -> tuple[str, ...]:
        """The facts some ``[memory.*]`` mode's ``when`` tests (sorted): ``memory_mode`` depends on these only."""
        return _tested_facts(ByIdentity(self))[0]

    def mode_for(self, facts: dict[str, Any]) -> MemoryMode | None:
        """The first mode whose ``when`` holds for ``facts`` (``config_facts``, or any dict with the
        ``mode_facts``), None when none does (memoized on the facts the modes test)."""
        me = ByIdentity(self)
        found = _first_mode(me, tuple(facts[f] for f in _tested_facts(me)[0]))
        return None if found is None else self.modes[found]

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

    def precisions_on(self, cluster: Any) -> tuple[str, ...]:
        """The precisions this target trains with whose GEMM rate every accelerator of ``cluster`` has
        (memoized, the target and the cluster by identity: both immutable)."""
        return _precisions_on(ByIdentity(self), ByIdentity(cluster))

    def check_precision(self, precision: str, cluster: Any) -> None:
        """ConfigError unless the target trains with ``precision`` and every accelerator of ``cluster`` has its
        GEMM rate, naming what would run instead."""
        if precision not in self.precisions:
            raise ConfigError(f"target {self.spec} has no {precision} training; it trains with "
                              f"{', '.join(self.precisions)}: choose --precision {' or '.join(self.precisions)}")
        if precision not in self.precisions_on(cluster):
            p = self.constants.precision(precision)
            gemm = p.gemm_dtype if not all(_has_rate(g.node.gpu, p.gemm_dtype) for g in cluster.groups) else p.requires
            gpus = sorted({g.node.gpu.name for g in cluster.groups if not _has_rate(g.node.gpu, gemm)})
            raise ConfigError(f"precision {precision} needs {gemm} tensor cores, which {', '.join(gpus)} lack; "
                              f"on this cluster choose --precision {' or '.join(self.precisions_on(cluster))}")

    def with_options(self, *names: str) -> "Target":
        """This target with ``names`` applied in order (ProfileError naming the options there are)."""
        known = {o.name: o for o in self.options}
        constants, applied, rules = self.constants, list(self.applied), self.cannot_run
        for n in names:
            if n not in known:
                raise ProfileError(f"target {self.name} has no option {n!r}; options: "
                                   f"{', '.join(known) or 'none'}")
            constants = dataclasses.replace(constants, **dict(known[n].constants))
            applied.append(n)
            rules += known[n].cannot_run
        return dataclasses.replace(self, constants=constants, applied=tuple(applied), cannot_run=rules)


def _has_rate(gpu: Any, dtype: str) -> bool:
    """Whether the accelerator runs ``dtype`` GEMMs (bf16 falls back to fp16 / fp32 as ``Accelerator.tflops``
    does; fp8 and fp4 need their own tensor cores)."""
    try:
        return gpu.tflops(dtype) > 0
    except ProfileError:
        return False


# --- memos of the rules' answers (the target and its rules are immutable): keyed by the facts the rules test


@functools.lru_cache(maxsize=64)
def _tested_facts(target: ByIdentity) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The facts some ``[memory.*]`` mode's ``when`` tests, and those some ``[[cannot_run]]`` rule's tests: the
    answers of ``memory_mode`` / which rules apply depend on these only."""
    t = target.obj
    return (tuple(sorted({c.fact for m in t.modes for c in m.when})),
            tuple(sorted({c.fact for r in t.cannot_run for c in r.when})))


@functools.lru_cache(maxsize=16384)
def _first_mode(target: ByIdentity, values: tuple) -> int | None:
    """The index of the first mode whose ``when`` holds where the tested facts take ``values``."""
    facts = dict(zip(_tested_facts(target)[0], values))
    for i, mode in enumerate(target.obj.modes):
        if all(c.holds(facts) for c in mode.when):
            return i
    return None


@functools.lru_cache(maxsize=16384)
def _applying_rules(target: ByIdentity, values: tuple) -> tuple[int, ...]:
    """The indices of the ``[[cannot_run]]`` rules that apply where their tested facts take ``values``."""
    facts = dict(zip(_tested_facts(target)[1], values))
    return tuple(i for i, r in enumerate(target.obj.cannot_run) if r.applies(facts))


@functools.lru_cache(maxsize=256)
def _precisions_on(target: ByIdentity, cluster: ByIdentity) -> tuple[str, ...]:
    gpus = [g.node.gpu for g in cluster.obj.groups]
    return tuple(p.name for p in target.obj.constants.precisions
                 if all(_has_rate(gpu, p.gemm_dtype) and (not p.requires or _has_rate(gpu, p.requires))
                        for gpu in gpus))


def load_target(spec: str, *, directory: str | Path | None = None) -> Target:
    """Read ``<directory or profiles/targets>/<name>.toml`` for ``spec`` = ``name`` or ``name:option[:option]``
    (options applied in order); ProfileError naming the file and key if malformed."""
    name, *options = str(spec).split(":")
    root = Path(directory) if directory else TARGETS_DIR
    path = root / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.toml")) if root.is_dir() else []
        raise ProfileError(f"unknown execution target {name!r}: no {path}; known targets: {', '.join(known)}")
    target = _load(str(path))
    return target.with_options(*options) if options else target


@functools.lru_cache(maxsize=16)
def _load(path: str) -> Target:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: invalid TOML: {e}") from None
    _check_keys(data, ("name", "framework", "source", "cannot_run", "memory", "precision", "options",
                       *CONSTANT_TABLES), path, "top level")
    rules = data.get("cannot_run", [])
    if not isinstance(rules, list):
        raise ProfileError(f"{path}: cannot_run must be an array of tables ([[cannot_run]])")
    memory = data.get("memory", {})
    if not isinstance(memory, dict) or not memory:
        raise ProfileError(f"{path}: needs at least one [memory.<mode>] table")
    cannot_run = tuple(_rule(r, path, f"cannot_run[{i}]") for i, r in enumerate(rules))
    modes = tuple(_mode(n, m, path) for n, m in memory.items())
    values, sources = _constants(data, path)
    precisions, args = _precisions(data.get("precision"), path, sources)
    return Target(
        name=_string(data, "name", path, "top level"),
        framework=_string(data, "framework", path, "top level"),
        source=_string(data, "source", path, "top level"),
        cannot_run=cannot_run, modes=modes,
        constants=StepConstants(**values, precisions=precisions),
        sources=tuple(sources.items()), precision_args=args,
        options=tuple(_option(n, o, path) for n, o in (data.get("options") or {}).items()),
    )


SELECTIVE = ("attention", "op")
_CHOICES: dict[str, tuple[str, ...]] = {"selective_recompute": SELECTIVE, "p2p_boundary": P2P_BOUNDARIES}


def _constant(value: Any, kind: type, path: str, where: str) -> Any:
    if value == "model" and where.startswith("comm."):
        return None  # the workload's own bytes per element (the dtype the parameters train in)
    if kind is str:
        choices = _CHOICES[where.rsplit(".", 1)[-1]]
        if value not in choices:
            raise ProfileError(f"{path}: [{where}] = {value!r}; choose one of {', '.join(choices)}")
        return value
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if not ok:
        wanted = "a number >= 0" if kind is float else kind.__name__
        raise ProfileError(f"{path}: [{where}] = {value!r} must be {wanted}")
    return float(value) if kind is float else value


def _constants(data: dict, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Every StepConstants field from the [kernels] / [overlap] / [comm] tables, with its source."""
    values, sources = {}, {}
    for table, fields in CONSTANT_TABLES.items():
        got = data.get(table)
        if not isinstance(got, dict):
            raise ProfileError(f"{path}: needs a [{table}] table with {', '.join(fields)}")
        _check_keys(got, tuple(fields), path, table)
        for key, kind in fields.items():
            entry = got.get(key)
            where = f"{table}.{key}"
            if not isinstance(entry, dict):
                raise ProfileError(f"{path}: [{where}] missing; write {key} = {{ value = .., source = \"..\" }}")
            _check_keys(entry, ("value", "source"), path, where)
            values[key] = _constant(entry.get("value"), kind, path, where)
            sources[key] = _string(entry, "source", path, where)
    return values, sources


def _precisions(data: Any, path: str, sources: dict[str, str]
                ) -> tuple[tuple[PrecisionConstants, ...], tuple[tuple[str, str], ...]]:
    if not isinstance(data, dict) or "bf16" not in data:
        raise ProfileError(f"{path}: needs [precision.<name>] tables, at least [precision.bf16]")
    out, args = [], []
    for name, entry in data.items():
        where = f"precision.{name}"
        if name not in PRECISIONS:
            raise ProfileError(f"{path}: [{where}] unknown precision {name!r}; precisions: {', '.join(PRECISIONS)}")
        if not isinstance(entry, dict):
            raise ProfileError(f"{path}: [{where}] must be a table")
        _check_keys(entry, _PRECISION_KEYS, path, where)
        gemm = _string(entry, "gemm_dtype", path, where)
        if gemm not in GEMM_DTYPES:
            raise ProfileError(f"{path}: [{where}] gemm_dtype = {gemm!r}; choose one of {', '.join(GEMM_DTYPES)}")
        nums = {k: _constant(entry.get(k, 0.0), float, path, f"{where}.{k}")
                for k in ("cast_bytes_per_element", "weight_bytes_per_param")}
        gather = entry.get("param_gather_bytes")
        requires = entry.get("requires", "")
        if requires not in ("", *GEMM_DTYPES):
            raise ProfileError(f"{path}: [{where}] requires = {requires!r}; choose one of {', '.join(GEMM_DTYPES)}")
        out.append(PrecisionConstants(
            name=name, gemm_dtype=gemm, requires=requires, **nums,
            param_gather_bytes=None if gather is None else _constant(gather, float, path,
                                                                      f"{where}.param_gather_bytes")))
        sources[where] = _string(entry, "source", path, where)
        if "megatron_args" in entry:
            args.append((name, _string(entry, "megatron_args", path, where) if entry["megatron_args"] else ""))
    return tuple(out), tuple(args)


def _option(name: str, data: Any, path: str) -> Option:
    where = f"options.{name}"
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: [{where}] must be a table")
    _check_keys(data, ("description", "source", "constants", "megatron_args", "cannot_run"), path, where)
    consts = data.get("constants")
    if not isinstance(consts, dict) or not consts:
        raise ProfileError(f"{path}: [{where}] needs constants = {{ name = value, ... }}")
    for key, value in consts.items():
        if key not in _CONSTANT_TYPES:
            raise ProfileError(f"{path}: [{where}] unknown constant {key!r}; constants: {', '.join(_CONSTANT_TYPES)}")
        consts[key] = _constant(value, _CONSTANT_TYPES[key], path, f"{where}.{key}")
    args = _string(data, "megatron_args", path, where) if data.get("megatron_args") else ""
    rules = data.get("cannot_run", [])
    if not isinstance(rules, list):
        raise ProfileError(f"{path}: [{where}] cannot_run must be an array of tables ([[{where}.cannot_run]])")
    return Option(name=name, description=_string(data, "description", path, where),
                  source=_string(data, "source", path, where), constants=tuple(consts.items()), megatron_args=args,
                  cannot_run=tuple(_rule(r, path, f"{where}.cannot_run[{i}]") for i, r in enumerate(rules)))


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
    _check_keys(data, ("when", "description", "source", "fsdp2", "autocast_weight_copies", "gradient_buffer",
                       *STATE_TERMS), path, where)
    terms = {t: _term(data.get(t, {}), path, f"{where}.{t}") for t in STATE_TERMS}
    fsdp2 = data.get("fsdp2", False)
    if not isinstance(fsdp2, bool):
        raise ProfileError(f"{path}: [{where}] fsdp2 = {fsdp2!r} must be true or false")
    extra = {}
    for key in ("autocast_weight_copies", "gradient_buffer"):
        value = data.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{path}: [{where}] {key} = {value!r} must be a number of bytes >= 0")
        extra[key] = float(value)
    return MemoryMode(name=name, when=_when(data.get("when", {}), path, where),
                      description=_string(data, "description", path, where),
                      source=_string(data, "source", path, where), fsdp2=fsdp2, **terms, **extra)


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
