"""What this process can measure: the one place that looks at the live hardware (``detect_device``), and the
accelerator profile name of a CUDA device."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 8.0


def gpu_profile_name(cuda_name: str, memory_gb: float) -> str:
    """The ``profiles/accelerators.toml`` entry for a CUDA device name (``NVIDIA H100 80GB HBM3``)."""
    n = cuda_name.upper()
    table = (
        ("H200", "H200-SXM-141GB"), ("B200", "B200-SXM-180GB"), ("L40S", "L40S"), ("MI300X", "MI300X"),
        ("H100 PCIE", "H100-PCIe-80GB"), ("H100", "H100-SXM5-80GB"),
    )  # fmt: skip
    for key, name in table:
        if key in n:
            return name
    if "A100" in n:
        pcie = "PCIE" in n
        big = memory_gb > 50
        return f"A100-{'PCIe' if pcie else 'SXM4'}-{'80' if big else '40'}GB"
    if "V100" in n:
        return "V100-SXM2-32GB" if memory_gb > 20 else "V100-SXM2-16GB"
    return cuda_name


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    device: str
    """torch device string: ``cpu`` or ``cuda``."""
    device_name: str
    accelerator: str
    memory_gb: float
    backend: str
    max_ranks: int
    cpu_cores: int = 0
    """Cores the ranks share (CPU; 0 on CUDA, where each rank has its own device)."""


def detect_device() -> DeviceInfo:
    """What this process can measure (the one place that looks at the live hardware)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        mem = props.total_memory / 1e9
        return DeviceInfo(
            device="cuda", device_name=props.name, accelerator=gpu_profile_name(props.name, mem), memory_gb=mem,
            backend="nccl", max_ranks=torch.cuda.device_count(),
        )  # fmt: skip
    cores = os.cpu_count() or 1
    return DeviceInfo(
        device="cpu", device_name=f"{cpu_name()} ({cores} cores)", accelerator="cpu-local",
        memory_gb=_host_memory_gb(), backend="gloo", max_ranks=64, cpu_cores=cores,
    )  # fmt: skip
