"""Plots are written, non-empty, and carry labelled axes with units and legends."""

import pytest

from _plans import make_plan, standin_plan
from planner.plots import pareto_front, plan_chunk_times, plot_gantt, write_whatif_plots
from planner.whatif import parse_sweep, run_whatif


def _png_ok(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.fixture
def captured_axes(monkeypatch):
    """Record the figures the plots save, to check their labels."""
    import matplotlib.figure

    figs = []
    real = matplotlib.figure.Figure.savefig

    def spy(self, *a, **kw):
        figs.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return figs


def _check_labels(fig):
    for ax in fig.axes:
        assert ax.get_xlabel() and "(" in ax.get_xlabel(), ax.get_xlabel()  # a unit in parentheses
        assert ax.get_ylabel() or ax.get_yticklabels()
    has_legend = bool(fig.legends) or any(ax.get_legend() is not None for ax in fig.axes)
    assert has_legend


def test_sweep_plots_written_with_labels(tmp_path, captured_axes):
    cases = parse_sweep(["gpu=a100-80gb,h100", "nodes=1,2,4", "gpus-per-node=4,8"])
    result = run_whatif("m", cases, global_batch=64, tokens=1e12, plan_fn=standin_plan)
    paths = write_whatif_plots(result, tmp_path, tokens=1e12)
    assert [p.name for p in paths] == ["whatif_throughput.png", "whatif_breakdown.png", "whatif_pareto.png"]
    for p in paths:
        _png_ok(p)
    for fig in captured_axes:
        _check_labels(fig)
    scaling = captured_axes[0]
    assert "tokens/s" in scaling.axes[0].get_ylabel() and "USD" in scaling.axes[1].get_ylabel()
    n_lines = len(scaling.axes[0].get_lines())
    assert n_lines == 2 * 2  # GPU x GPUs-per-node (one NIC rate)
    bars = captured_axes[1].axes[0]
    assert {t.get_text() for t in bars.get_legend().get_texts()} == {"compute", "comm_nvswitch", "bubble",
                                                                      "optimizer"}


@pytest.mark.parametrize(
    "kw",
    [dict(pp=4, schedule="1f1b"), dict(pp=2, virtual_stages=2, schedule="interleaved-1f1b", tp=4),
     dict(pp=4, schedule="zero-bubble", virtual_stages=2, recompute="none"), dict(pp=4, schedule="gpipe")],
)
def test_gantt_shows_every_microbatch_and_bubbles(tmp_path, captured_axes, kw):
    plan = make_plan(**kw)
    path = plot_gantt(plan, tmp_path / "g.png")
    _png_ok(path)
    fig = captured_axes[-1]
    _check_labels(fig)
    ax, ax_mem = fig.axes
    s = plan.schedule
    kinds = 3 if s.name == "zero-bubble" else 2
    # one idle background bar per stage + one bar per (stage, chunk, micro-batch, kind)
    assert len(ax.patches) == plan.degrees.pp * (1 + kinds * s.virtual_stages * s.num_microbatches)
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"idle (bubble)", "forward", "backward"} <= legend
    assert "bubble" in ax.get_title() and "% of the step" in ax.get_title()
    d = plan.degrees
    assert f"tp={d.tp} cp={d.cp} pp={d.pp} dp={d.dp} ep={d.ep}" in fig._suptitle.get_text()
    assert "GB" in ax_mem.get_xlabel() and len(ax_mem.patches) == plan.degrees.pp


def test_gantt_numbers_stay_legible_with_many_microbatches(tmp_path, captured_axes):
    """64 micro-batches on 4 stages: numbers only on bars wide enough for them, and the title says so."""
    plan = make_plan(pp=4, schedule="1f1b", num_microbatches=64, dp=1)
    plot_gantt(plan, tmp_path / "g.png")
    ax = captured_axes[-1].axes[0]
    numbered = [t for t in ax.texts if t.get_text().isdigit()]
    assert "on bars wide enough" in ax.get_title() or "too many" in ax.get_title()
    assert len(numbered) < 4 * 2 * 64
    few = make_plan(pp=4, schedule="1f1b", num_microbatches=8)
    plot_gantt(few, tmp_path / "few.png")
    ax = captured_axes[-1].axes[0]
    assert len([t for t in ax.texts if t.get_text().isdigit()]) == 4 * 2 * 8 and "(numbers: micro-batch)" in ax.get_title()


def test_chunk_times_add_up_to_the_stage_times():
    plan = make_plan(recompute="full", schedule="zero-bubble", virtual_stages=2)
    tf, tb, tw = plan_chunk_times(plan)
    for st, f, b, w in zip(plan.stages, tf, tb, tw):
        assert f + b + w == pytest.approx(st.predicted_time_s)
        assert b + w == pytest.approx(3 * f)  # full recomputation runs the forward again in backward


def test_pareto_front():
    pts = [(1, 5), (2, 3), (3, 4), (4, 1), (2, 6)]
    assert pareto_front(pts) == [0, 1, 3]
