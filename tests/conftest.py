"""Shared pytest set-up and the test tiers (markers): ``unit`` (pure: cost model, DPs, plan files, exports,
plots of hand-made plans), ``planner`` (traces a model or runs the search, in one process), ``distributed``
(2-4 gloo ranks), ``slow`` (> 30 s, run with ``-m slow``), ``gpu`` (needs CUDA).

``distributed``, ``slow`` and ``gpu`` are marked on the tests; ``unit`` or ``planner`` is added here by file
(``UNIT_FILES``; any other file is ``planner``) to every test not marked ``distributed`` or ``gpu``.
Select a tier with ``python -m pytest -m unit`` (the default run leaves out ``slow`` and ``gpu``).
"""

import os
from pathlib import Path

import pytest

# Keep intra-op threads low: the machine has 2 cores and distributed tests spawn several ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

UNIT_FILES = frozenset({
    "test_calibration", "test_comm", "test_compute", "test_export", "test_layers", "test_memory", "test_pipeline",
    "test_plan_file", "test_plots", "test_profiles", "test_stage_dp", "test_step",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("gpu"):
            continue
        item.add_marker(pytest.mark.unit if Path(str(item.fspath)).stem in UNIT_FILES else pytest.mark.planner)
