"""The hand-written models of ``tests/models`` (plain torch.nn) built through ``module:function`` specs: they
build on meta at the published sizes and run a real forward on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from planner.models import build_model

SPECS = ["tests.models.gpt:small", "tests.models.gpt:untied", "tests.models.gpt:manual", "tests.models.gpt:fused",
         "tests.models.mlp:tiny", "tests.models.vit:tiny", "tests.models.cnn:small"]


def gpt_params(*, l: int, h: int, V: int, s: int, ffn: int, tied: bool) -> int:
    layer = 4 * (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h  # q/k/v/o, fc1, fc2, 2 LayerNorms
    return V * h + s * h + l * layer + 2 * h + (0 if tied else V * h)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS)
def test_builds_on_meta_and_runs_on_cpu(spec):
    b = build_model(spec, batch=2)
    assert {p.device.type for p in b.model.parameters()} == {"meta"}
    cpu = build_model(spec, batch=2, device="cpu")
    torch.manual_seed(0)
    for p in cpu.model.parameters():
        p.data.normal_(0, 0.02)
    out = cpu.model(*cpu.example_inputs)
    assert out.shape[0] == 2 and torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in cpu.model.parameters())


def test_published_sizes():
    assert _numel(build_model("tests.models.gpt:small").model) == gpt_params(l=4, h=256, V=1000, s=128, ffn=1024,
                                                                              tied=True)
    assert _numel(build_model("tests.models.gpt:untied").model) == gpt_params(l=3, h=128, V=500, s=64, ffn=512,
                                                                               tied=False)
    assert _numel(build_model("tests.models.vit:vit_l16").model) == 304_326_632  # timm vit_large_patch16_224
    w, f = 8192, 32768
    assert _numel(build_model("tests.models.mlp:mlp_8b").model) == (1024 * w + w) + 16 * (2 * w + 2 * w * f + f + w) \
        + (w * 1000 + 1000)


def test_mlp_8b_builds_in_little_memory():
    """In a fresh process (its own peak RSS): 8.6B parameters would be 34 GB in fp32."""
    code = ("import resource; from planner.models import build_model; "
            "b = build_model('tests.models.mlp:mlp_8b'); "
            "print(sum(p.numel() for p in b.model.parameters()), "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    params, rss_kb = int(out[0]), int(out[1])
    assert params == 8_607_441_896
    assert rss_kb < 1.5 * 2**20  # < 1.5 GB peak
