"""What a benchmark ran on, for its JSON: timings only compare on the same machine and load."""
from __future__ import annotations

import os
import platform
from typing import Dict, Optional

import torch


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux, else what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> Optional[float]:
    """1-minute load average (None where the OS has none): how many other jobs share the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_info() -> Dict[str, object]:
    """CPU model, cores (logical, and those this process may use), torch version and intra-op
    threads, the CUDA device when there is one, and the load average when called."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": cpu_model(), "cpu_cores": os.cpu_count(), "usable_cores": usable,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average": load_average()}
