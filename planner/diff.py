"""What changed between two plans, and what the cost model predicts the change does.

``diff_plans(a, b)`` compares the model, the cluster, the parallel degrees, the schedule, ZeRO, sequence
parallelism, recomputation, stage cuts and module shardings, and sets the predictions side by side: step time,
throughput, MFU, memory per device, the bottleneck link and every term of the step-time breakdown. Plans of
different models get no speed verdict. ``format_diff`` is the text, ``PlanDiff.to_dict`` the JSON.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from planner.export import layers_per_stage
from planner.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    field: str
    a: str
    b: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Effect:
    """One predicted number in a and b; ``ratio`` = b / a (NaN when a is 0 or either is missing)."""

    metric: str
    unit: str
    a: float
    b: float

    @property
    def delta(self) -> float:
        return self.b - self.a

    @property
    def ratio(self) -> float:
        return self.b / self.a if self.a and math.isfinite(self.a) and math.isfinite(self.b) else math.nan


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDiff:
    changes: tuple[Change, ...]
    effects: tuple[Effect, ...]
    """Step time, throughput, MFU, memory: always listed, changed or not."""
    breakdown: tuple[Effect, ...]
    """Terms of ``Prediction.breakdown_s`` present in either plan."""
    bottleneck: tuple[str, str]
    same_model: bool

    @property
    def identical(self) -> bool:
        return not self.changes

    def summary(self) -> str:
        """A one-line verdict: b's step time against a's (percent of a's), and the memory change."""
        step, mem = self.effects[0], self.effects[3]
        times = f"{step.a:.4g} s -> {step.b:.4g} s per step"
        if not self.same_model:
            return f"no speed verdict: the plans are for different models ({times})"
        if not math.isfinite(step.ratio):
            return "predicted step times cannot be compared"
        pct = abs(step.ratio - 1.0) * 100.0
        if pct < 0.05:  # what .1f would print as 0.0%
            verdict = "b is as fast as a"
        else:
            verdict = f"b is {pct:.1f}% {'faster' if step.b < step.a else 'slower'} than a"
        return f"{verdict} ({times}), memory per device {mem.a:.2f} -> {mem.b:.2f} GB"

    def to_dict(self) -> dict[str, Any]:
        """The ``autopar diff --json`` object (NaN ratios become null)."""
        def effect(e: Effect) -> dict[str, Any]:
            return {**dataclasses.asdict(e), "delta": e.delta, "ratio": e.ratio if math.isfinite(e.ratio) else None}

        return {"identical": self.identical, "same_model": self.same_model,
                "changes": [dataclasses.asdict(c) for c in self.changes],
                "effects": [effect(e) for e in self.effects], "breakdown": [effect(e) for e in self.breakdown],
                "bottleneck": list(self.bottleneck), "summary": self.summary()}


def _plan_fields(p: Plan) -> dict[str, str]:
    d, s = p.degrees, p.schedule
    return {
        "model": f"{p.model.name} ({p.model.fingerprint})",
        "cluster": f"{p.cluster.name}: {p.cluster.nodes}x{p.cluster.gpus_per_node} {p.cluster.gpu}",
        "global_batch": str(p.global_batch),
        "degrees": f"tp={d.tp} cp={d.cp} pp={d.pp} dp={d.dp} ep={d.ep}",
        "schedule": s.name,
        "microbatch_size": str(s.microbatch_size),
        "num_microbatches": str(s.num_microbatches),
        "virtual_stages": str(s.virtual_stages),
        "zero_stage": str(p.zero_stage),
        "sequence_parallel": str(p.sequence_parallel).lower(),
        "recompute": _per_stage([st.recompute for st in p.stages]),
        "layers_per_stage": ",".join(map(str, layers_per_stage(p))),
    }


def _per_stage(values: list[str]) -> str:
    """One value when every stage has it, else one per stage."""
    return values[0] if len(set(values)) == 1 else ",".join(values)


def _sharding_changes(a: Plan, b: Plan) -> list[Change]:
    sa = {m.fqn: m.style for m in a.shardings}
    sb = {m.fqn: m.style for m in b.shardings}
    changed = sorted(f for f in sa.keys() | sb.keys() if sa.get(f) != sb.get(f))
    if not changed:
        return []
    shown = ", ".join(f"{f}: {sa.get(f, '-')} -> {sb.get(f, '-')}" for f in changed[:5])
    more = f" (+{len(changed) - 5} more)" if len(changed) > 5 else ""
    return [Change(field="shardings", a=f"{len(sa)} modules", b=f"{len(changed)} changed: {shown}{more}")]


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    fa, fb = _plan_fields(a), _plan_fields(b)
    changes = [Change(field=k, a=fa[k], b=fb[k]) for k in fa if fa[k] != fb[k]]
    changes += _sharding_changes(a, b)
    pa, pb = a.prediction, b.prediction
    effects = (
        Effect(metric="step_time", unit="s", a=pa.step_time_s, b=pb.step_time_s),
        Effect(metric="throughput", unit="tokens/s", a=pa.tokens_per_s, b=pb.tokens_per_s),
        Effect(metric="mfu", unit="%", a=pa.mfu, b=pb.mfu),
        Effect(metric="memory_per_device", unit="GB", a=pa.memory_gb_per_device, b=pb.memory_gb_per_device),
        Effect(metric="model_tflops_per_gpu", unit="TFLOP/s", a=pa.model_tflops_per_gpu, b=pb.model_tflops_per_gpu),
    )
    terms = list(dict.fromkeys([*pa.breakdown_s, *pb.breakdown_s]))
    breakdown = tuple(
        Effect(metric=t, unit="s", a=pa.breakdown_s.get(t, 0.0), b=pb.breakdown_s.get(t, 0.0)) for t in terms
    )
    if pa.fits != pb.fits:
        changes.append(Change(field="fits", a=str(pa.fits).lower(), b=str(pb.fits).lower()))
    return PlanDiff(
        changes=tuple(changes),
        effects=effects,
        breakdown=breakdown,
        bottleneck=(pa.bottleneck, pb.bottleneck),
        same_model=a.model.fingerprint == b.model.fingerprint,
    )


def _number(e: Effect, v: float) -> str:
    """As ``autopar plan`` prints them: tokens/s whole with thousands separators, MFU in percent."""
    if e.unit == "tokens/s":
        return f"{v:,.0f}"
    if e.unit == "%":
        return f"{100 * v:.1f}"
    if e.unit in ("GB", "TFLOP/s"):
        return f"{v:.2f}"
    return f"{v:.4g}"


def format_diff(diff: PlanDiff) -> str:
    """Human-readable text of a diff (what ``autopar diff`` prints)."""
    lines = []
    if diff.identical:
        lines.append("the plans are identical in every setting")
    else:
        width = max(len(c.field) for c in diff.changes)
        lines.append("changed settings (a -> b):")
        lines += [f"  {c.field:<{width}}  {c.a}  ->  {c.b}" for c in diff.changes]
    if not diff.same_model:
        lines.append("the plans are for different models: their predictions are not comparable")
    lines.append("")
    lines.append("predicted effect:")
    rows = [(e.metric, e) for e in diff.effects] + [(f"  {e.metric}", e) for e in diff.breakdown]
    for name, e in rows:
        ratio = f"x{e.ratio:.3f}" if math.isfinite(e.ratio) else "-"
        a, b, delta = (_number(e, v) for v in (e.a, e.b, e.delta))
        delta = delta if delta.startswith("-") else "+" + delta
        lines.append(f"  {name:<22} {a:>12} -> {b:<12} {e.unit:<9} {delta} ({ratio})")
    ba, bb = diff.bottleneck
    lines.append(f"  bottleneck             {ba or '-'} -> {bb or '-'}")
    lines.append("")
    lines.append(diff.summary())
    return "\n".join(lines) + "\n"
