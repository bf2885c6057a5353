# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the GPUs hold: the GPUs of this host (NVML, else nvidia-smi) and the driver's version,
and the GPU memory each process holds."""
from __future__ import annotations

import re

from ..core.run import find_binary, run


def gpus():
    """GPUs of this host through NVML (nvidia-ml-py) when installed, else nvidia-smi, else []."""
    try:
        import pynvml  # noqa: WPS433 - optional dependency
        pynvml.nvmlInit()
        try:
            out = []
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                            "memory_total_mib": mem.total // 2**20, "memory_used_mib": mem.used // 2**20,
                            "memory_free_mib": mem.free // 2**20, "driver_version": drv})
            return out, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML absent or broken: fall back to nvidia-smi
        pass
    smi = find_binary("nvidia-smi", required=False)
    if not smi:
        return [], None
    res = run([smi, "--query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version",
               "--format=csv,noheader,nounits"], timeout=30, check=False)
    out = []
    if res.rc == 0:
        for line in res.stdout.splitlines():
            f = [x.strip() for x in line.split(",")]
            if len(f) == 7:
                out.append({"index": int(f[0]), "name": f[1], "uuid": f[2], "memory_total_mib": int(f[3]),
                            "memory_used_mib": int(f[4]), "memory_free_mib": int(f[5]), "driver_version": f[6]})
    return out, "nvidia-smi"


def gpu_memory_by_pid():
    """{pid: bytes of GPU memory} through NVML, {} when NVML is not installed."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                out[proc.pid] = out.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
    except Exception:  # noqa: BLE001
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


def driver_version():
    """The kernel driver's version string (e.g. 580.159.04), or None."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9.]+)", fh.read())
            return m.group(1) if m else None
    except OSError:
        return None
