"""One description of the machine a figure was measured on, for every report."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from memspec.common import isa


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
            "isa": isa.chosen_isa(), "isa_native": isa.native_isa(), "arch": platform.machine(),
            "device": "cuda" if gpu else "cpu", "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def machine_line() -> str:
    info = machine_info()
    if info["gpu"]:
        return f"GPU {info['gpu']}"
    forced = "" if info["isa"] == info["isa_native"] else f", forced from {info['isa_native']}"
    return f"CPU {info['cpu']} ({info['isa']} kernels{forced}), {info['torch_threads']} threads"
