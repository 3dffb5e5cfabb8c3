"""``benchmarks/gpu_check.sh``, the prepared device check, run here on the CPU (``GPU_CHECK_ALLOW_CPU=1``) with a
tiny model: the script must not rot where no GPU is. It writes a loadable calibration profile and one
validate row per recomputation mode, each with a measured step time and memory beside the prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = "llama:layers=2,hidden=128,ffn=256,heads=4,kv_heads=4,vocab=512,seq=64"


def test_gpu_check_script_on_cpu(tmp_path):
    env = dict(os.environ, GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_MODEL=TINY, GPU_CHECK_BATCH="4", GPU_CHECK_STEPS="1",
               PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    from costmodel.profiles import load_calibration

    cal = load_calibration(tmp_path / "cpu-local.json")
    assert cal.matmul and cal.matmul_fits and cal.membound_gbps > 0, "the profile holds no compute measurement"
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["plan"].split(" rc=")[-1].split()[0] if " rc=" in r["plan"] else "none" for r in rows] == \
        ["none", "selective", "full"]
    for r in rows:
        assert r["measured_s"] > 0 and r["measured_gb"] > 0 and r["predicted_tensor_gb"] > 0
        assert r["memory_error"] == pytest.approx((r["predicted_tensor_gb"] - r["measured_gb"]) / r["measured_gb"])
    assert "within 15% of the predicted step time" in (tmp_path / "gpu_check.log").read_text()
