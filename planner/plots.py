"""Pictures of a what-if study and of one plan (matplotlib figures written to PNG files; no pyplot, no display).

- ``plot_scaling``: throughput (tokens/s) and cost (USD per million tokens) against GPU count, one line per
  topology (GPU, GPUs per node, intra-node link, inter-node bandwidth).
- ``plot_breakdown``: stacked bars of where each cluster's step time goes (compute, exposed communication per
  link kind, pipeline bubble, optimizer, ...).
- ``plot_pareto``: time against cost to train, the Pareto-optimal clusters joined and named.
- ``plot_gantt``: one plan's pipeline schedule as ``costmodel.pipeline.simulate`` simulates it (the
  order torch.distributed.pipelining executes): forward / backward / weight-gradient per stage and micro-batch
  on a grey idle background, so bubbles show, titled with explain's bubble share; and a memory bar per stage.

Every function takes the data and an output path, writes one PNG and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from costmodel.errors import ProfileError
from costmodel.pipeline import simulate
from costmodel.profiles import get_accelerator
from planner.plan import Plan
from planner.whatif import plan_breakdowns

_KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
_IDLE_COLOR = "#E5E5E5"


def _save(fig: Any, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110, bbox_inches="tight")
    return p


def _feasible(table: Any) -> Any:
    return table[(table["status"] == "ok") & (table["tokens_per_s"] > 0)]


def _topology_lines(table: Any) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Rows grouped into lines over GPU count, each with its style: colour = GPU, line style = NIC rate,
    marker = GPUs per node and intra-node link. Single-node rows (no inter-node link) join every line."""
    colors = {g: matplotlib.colormaps["tab10"](i % 10) for i, g in enumerate(dict.fromkeys(table["gpu"]))}
    dashes = {r: ("-", "--", ":", "-.")[i % 4] for i, r in enumerate(sorted(table["nic_gbit_s"].dropna().unique()))}
    node_kinds = list(dict.fromkeys(zip(table["gpus_per_node"], table["intra"])))
    markers = {k: "osD^v<>ph"[i % 9] for i, k in enumerate(node_kinds)}
    lines: dict[str, tuple[Any, dict[str, Any]]] = {}
    for key, group in table.groupby(["gpu", "gpus_per_node", "intra"], sort=False, dropna=False):
        single = group[group["nic_gbit_s"].isna()]
        multi = group[group["nic_gbit_s"].notna()]
        base = f"{key[0]} {key[1]}/node {key[2]}"
        style = {"color": colors[key[0]], "marker": markers[(key[1], key[2])]}
        if multi.empty:
            lines[base] = (single, {**style, "linestyle": "-"})
            continue
        for gbps, sub in multi.groupby("nic_gbit_s", sort=True):
            lines[f"{base} {gbps:g} Gb/s NIC"] = (pd.concat([single, sub]).sort_values("gpus"),
                                                  {**style, "linestyle": dashes[gbps]})
    return lines


def plot_scaling(table: Any, path: str | Path, *, title: str = "") -> Path:
    """Throughput and cost per token vs GPU count, a line per topology; infeasible cases counted below."""
    ok = _feasible(table)
    fig = Figure(figsize=(13, 5))
    ax_t, ax_c = fig.subplots(1, 2)
    for name, (rows, style) in _topology_lines(ok).items():
        rows = rows.sort_values("gpus")
        ax_t.plot(rows["gpus"], rows["tokens_per_s"], label=name, **style)
        ax_c.plot(rows["gpus"], rows["usd_per_mtok"], label=name, **style)
    for ax in (ax_t, ax_c):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_plain_formatter())
        ax.set_xlabel("GPUs (count, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("throughput (tokens/s, log scale)")
    ax_t.set_title("predicted training throughput")
    ax_c.set_ylabel("cost (USD per million tokens)")
    ax_c.set_title("cost per token")
    unpriced = sorted(set(ok.loc[ok["usd_per_mtok"].isna(), "gpu"]))
    if unpriced:
        ax_c.set_title(f"cost per token\n(not drawn, no price in the node profiles: {', '.join(unpriced)})",
                       fontsize=10)
    handles, labels = ax_t.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8,
                   title="topology (GPU, GPUs per node, intra-node link, NIC Gb/s per GPU)")
    bad = len(table) - len(ok)
    sup = title or "what-if: throughput and cost vs GPU count"
    if bad:
        sup += f"  ({bad} infeasible case{'s' if bad > 1 else ''} not drawn)"
    fig.suptitle(sup)
    return _save(fig, path)


def _plain_formatter(*, leading: str = "", thousands: bool = False) -> Any:
    """Tick labels as plain numbers; ``leading``: label only values whose first digit is in it (minor ticks)."""
    def fmt(v: float, _pos: Any) -> str:
        if leading and f"{v:e}"[0] not in leading:
            return ""
        return f"{v:,.0f}" if thousands and abs(v) >= 1000 else f"{v:g}"

    return FuncFormatter(fmt)


def plot_breakdown(table: Any, breakdowns: dict[str, dict[str, float]], path: str | Path, *,
                   title: str = "") -> Path:
    """Stacked horizontal bars: seconds per step in each term of the predicted breakdown, per cluster."""
    labels = [c for c in _feasible(table)["cluster"] if c in breakdowns]
    terms = list(dict.fromkeys(t for c in labels for t in breakdowns[c]))
    fig = Figure(figsize=(11, max(3.0, 0.32 * len(labels) + 1.5)))
    ax = fig.subplots()
    left = [0.0] * len(labels)
    cmap = matplotlib.colormaps["tab10"]
    for j, term in enumerate(terms):
        widths = [max(0.0, breakdowns[c].get(term, 0.0)) for c in labels]
        ax.barh(labels, widths, left=left, color=cmap(j % 10), label=term)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("time per optimizer step (s)")
    ax.set_ylabel("cluster")
    ax.set_title(title or "where the step time goes (best plan per cluster)")
    if terms:
        ax.legend(title="term", loc="lower right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (x, y), both minimised, sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_y = [], math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def plot_pareto(table: Any, path: str | Path, *, tokens: float | None = None, title: str = "") -> Path:
    """Time vs cost: to train ``tokens`` if given (days, USD), else per million tokens (s, USD)."""
    ok = _feasible(table)
    ok = ok[ok["usd_per_mtok"].notna()]
    if tokens:
        xs = list(tokens / ok["tokens_per_s"] / 86400.0)
        ys = list(ok["usd_per_mtok"] * tokens / 1e6)
        xlabel, ylabel = f"time to train {tokens:.3g} tokens (days)", f"cost to train {tokens:.3g} tokens (USD)"
    else:
        xs = list(1e6 / ok["tokens_per_s"])
        ys = list(ok["usd_per_mtok"])
        xlabel, ylabel = "time per million tokens (s)", "cost per million tokens (USD)"
    names = list(ok["cluster"])
    fig = Figure(figsize=(9, 6))
    ax = fig.subplots()
    ax.scatter(xs, ys, color="#8C8C8C", label="cluster (best plan)")
    front = pareto_front(list(zip(xs, ys)))
    if front:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], color="#C44E52", marker="o", label="Pareto front")
        for i in front:
            ax.annotate(names[i], (xs[i], ys[i]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_plain_formatter())
    ax.xaxis.set_minor_formatter(_plain_formatter(leading="25"))
    ax.yaxis.set_major_formatter(_plain_formatter(thousands=True))
    ax.set_xlabel(xlabel + ", log scale")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "time vs cost: Pareto-optimal clusters")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


# --- one plan ---------------------------------------------------------------------------------------------


def plan_chunk_times(plan: Plan) -> tuple[list[float], list[float], list[float]]:
    """Per chunk (torch stage index): forward, backward and weight-gradient seconds of one micro-batch.

    ``StagePlan.predicted_time_s`` is forward + backward; backward is taken as twice the forward (three
    times with full recomputation, which runs the forward again); zero-bubble splits backward into equal
    input-gradient and weight-gradient halves.
    """
    tf, tb, tw = [], [], []
    for st in sorted(plan.stages, key=lambda s: s.index):
        share = 4.0 if st.recompute == "full" else 3.0
        f = st.predicted_time_s / share
        b = st.predicted_time_s - f
        if plan.schedule.name == "zero-bubble":
            tf.append(f), tb.append(b / 2), tw.append(b / 2)
        else:
            tf.append(f), tb.append(b), tw.append(0.0)
    return tf, tb, tw


def bubble_share(plan: Plan) -> float:
    """The step's pipeline bubble as a share of the predicted step time: the ``bubble`` term of the plan's
    breakdown, as ``autopar explain`` lists it (the busiest pipeline rank's idle time in the schedule)."""
    total = sum(plan.prediction.breakdown_s.values())
    return plan.prediction.breakdown_s.get("bubble", 0.0) / total if total > 0 else 0.0


def simulated_bubble_s(events: list[Any], pp: int) -> float:
    """Idle seconds of the busiest rank between the first event and the last: what the step model's bubble
    term prices, read off the drawn schedule."""
    busy = [sum(e.end_s - e.start_s for e in events if e.stage == r) for r in range(pp)]
    return max(e.end_s for e in events) - max(busy)


_LABEL_INCHES_PER_DIGIT = 0.055
"""Width a micro-batch number needs per digit at the Gantt's 6 pt font, plus ``_LABEL_MARGIN_INCHES``."""
_LABEL_MARGIN_INCHES = 0.04
_GANTT_AXIS_INCHES = 10.5
"""Width of the schedule's axis in the 14-inch figure (4 of 5 parts, less the labels)."""


def plot_gantt(plan: Plan, path: str | Path) -> Path:
    """The plan's pipeline schedule per stage and micro-batch, and the memory of each stage.

    Each bar carries its micro-batch number where the bar is wide enough for it (many micro-batches: the
    number stands on every bar that has room). The title's bubble figure is ``bubble_share`` (explain's)."""
    s, d = plan.schedule, plan.degrees
    pp = d.pp
    tf, tb, tw = plan_chunk_times(plan)
    events = simulate(s.name, pp=pp, num_microbatches=s.num_microbatches, virtual_stages=s.virtual_stages,
                      t_fwd_s=tf, t_bwd_s=tb, t_wgrad_s=tw)
    end_s = max(e.end_s for e in events)
    unit, scale = ("ms", 1e3) if end_s < 10 else ("s", 1.0)
    fig = Figure(figsize=(14, max(3.0, 0.55 * pp + 1.8)))
    ax, ax_m = fig.subplots(1, 2, gridspec_kw={"width_ratios": [4, 1]})
    ax.barh(range(pp), [end_s * scale] * pp, color=_IDLE_COLOR, height=0.8)
    labelled = 0
    for e in events:
        alpha = 1.0 - 0.45 * (e.chunk % 2)  # interleaved chunks alternate shade
        ax.barh(e.stage, (e.end_s - e.start_s) * scale, left=e.start_s * scale, height=0.8,
                color=_KIND_COLORS[e.kind], alpha=alpha, edgecolor="white", linewidth=0.5)
        width_in = (e.end_s - e.start_s) / end_s * _GANTT_AXIS_INCHES
        if width_in >= _LABEL_MARGIN_INCHES + _LABEL_INCHES_PER_DIGIT * len(str(e.microbatch)):
            labelled += 1
            ax.text((e.start_s + e.end_s) / 2 * scale, e.stage, str(e.microbatch), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(pp), [f"stage {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time within one optimizer step ({unit})")
    ax.set_ylabel("pipeline stage (rank)")
    vtxt = f", {s.virtual_stages} chunks per stage" if s.virtual_stages > 1 else ""
    numbers = ("numbers: micro-batch" if labelled == len(events) else
               "numbers: micro-batch, on bars wide enough" if labelled else "too many micro-batches to number")
    ax.set_title(f"{s.name}: pp={pp}, {s.num_microbatches} micro-batches{vtxt}; bubble "
                 f"{100 * bubble_share(plan):.1f}% of the step ({numbers})", fontsize=10)
    ax.legend(handles=_gantt_legend(sorted({e.kind for e in events}, key="FBW".index), s.virtual_stages),
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, fontsize=8)
    _memory_bars(ax_m, plan)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.name}: tp={d.tp} cp={d.cp} pp={pp} dp={d.dp} ep={d.ep}",
                 y=1.03)
    return _save(fig, path)


def _gantt_legend(kinds: list[str], virtual_stages: int) -> list[Any]:
    handles = [Patch(color=_IDLE_COLOR, label="idle (bubble)")]
    handles += [Patch(color=_KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds]
    if virtual_stages > 1:
        handles.append(Patch(color=_KIND_COLORS["F"], alpha=0.55, label="lighter: odd chunk of a stage"))
    return handles


def _memory_bars(ax: Any, plan: Plan) -> None:
    pp = plan.degrees.pp
    mem = [0.0] * pp
    for st in plan.stages:
        mem[st.pp_rank] = max(mem[st.pp_rank], st.predicted_memory_gb)  # per rank, repeated on each chunk
    ax.barh(range(pp), mem, color="#8172B2", height=0.6, label="predicted")
    cap = _device_memory_gb(plan)
    if cap is not None:
        ax.axvline(cap, color="#C44E52", linestyle="--", label=f"device memory {cap:g} GB")
    ax.set_yticks(range(pp), [f"stage {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("memory per device (GB)")
    ax.set_title("memory per stage", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8)


def _device_memory_gb(plan: Plan) -> float | None:
    names = {st.gpu for st in plan.stages if st.gpu} or set(plan.cluster.gpu.split("+"))
    caps = []
    for name in names:
        try:
            caps.append(get_accelerator(name).memory_gb)
        except ProfileError:
            return None
    return min(caps) if caps else None


def write_whatif_plots(result: Any, out_dir: str | Path, *, tokens: float | None = None) -> list[Path]:
    """All sweep plots of a ``planner.whatif.WhatIfResult`` into ``out_dir``; returns the files."""
    out = Path(out_dir)
    return [
        plot_scaling(result.table, out / "whatif_throughput.png"),
        plot_breakdown(result.table, plan_breakdowns(result.plans), out / "whatif_breakdown.png"),
        plot_pareto(result.table, out / "whatif_pareto.png", tokens=tokens),
    ]
