"""One description of the machine a figure was measured on, for every report."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": "cuda" if gpu else "cpu", "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def machine_line() -> str:
    info = machine_info()
    if info["gpu"]:
        return f"GPU {info['gpu']}"
    return f"CPU {info['cpu']}, {info['torch_threads']} threads"
