# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the GPUs hold: the GPUs of this host (NVML, else nvidia-smi) and the driver's version,
and the GPU memory each process holds.

Unknown is never zero. A migration's preflight sizes the image (host RSS + GPU memory) and the target's
GPUs from these readings: a GPU memory counted as 0 because nothing could read it once passed a disk
check for a 25.6 GB image estimated at 1.3 GiB, and CRIU hit ENOSPC 16 GB into the dump. So each reader
says where its figures came from, and a figure nothing could read is None:
- ``gpus()``: ``(list, source)``, source ``"nvml"``, ``"nvidia-smi"`` or None (neither answered: the list
  is then [] and means "not known", not "no GPU"); a GPU's ``memory_free_mib`` (and total, used) is None
  when its driver does not report it (``[N/A]``).
- ``compute_apps()`` / ``gpu_memory_by_pid()``: ``(readings or None, source)``; None when neither NVML
  nor nvidia-smi answered; a process listed without a memory figure has None.

``$GPUCKPT_NVIDIA_SMI`` names the nvidia-smi to run (a node agent whose PATH lacks it; the tests' double).
"""
from __future__ import annotations

import os
import re

from ..core.errors import GpuCkptError
from ..core.run import find_binary, run
from . import devices

GPU_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "memory.free", "driver_version")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory")
MIB = 2**20


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _number(field):
    """An integer nvidia-smi printed, or None for what it could not read (``[N/A]``, ``[Not Supported]``)."""
    try:
        return int(field)
    except (TypeError, ValueError):
        return None


def nvidia_smi():
    """The nvidia-smi to ask ($GPUCKPT_NVIDIA_SMI, else PATH and the usual places), or None."""
    try:
        return find_binary("nvidia-smi", explicit=os.environ.get("GPUCKPT_NVIDIA_SMI"), required=False)
    except GpuCkptError:
        return None


def _smi_rows(query, fields):
    """The rows nvidia-smi answers to ``--query-<query>=<fields>`` (each a list of stripped fields), or None
    when it is not installed or fails (no driver loaded: it then knows nothing)."""
    smi = nvidia_smi()
    if not smi:
        return None
    res = run([smi, "--query-%s=%s" % (query, ",".join(fields)), "--format=csv,noheader,nounits"],
              timeout=30, check=False)
    if res.rc != 0:
        return None
    rows = [[x.strip() for x in line.split(",")] for line in res.stdout.splitlines() if line.strip()]
    return [r for r in rows if len(r) == len(fields)]


def _nvml_memory(pynvml, handle):
    """(total, used, free) MiB of one GPU through NVML; None each where it does not report them."""
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # noqa: BLE001 - NVML_ERROR_NOT_SUPPORTED and the like: not known, not 0
        return None, None, None
    return mem.total // MIB, mem.used // MIB, mem.free // MIB


def _nvml_gpus(pynvml):
    drv = _text(pynvml.nvmlSystemGetDriverVersion())
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        total, used, free = _nvml_memory(pynvml, h)
        out.append({"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)), "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                    "memory_total_mib": total, "memory_used_mib": used, "memory_free_mib": free,
                    "driver_version": drv})
    return out


def _with_nvml(read):
    """``read(pynvml)`` between nvmlInit and nvmlShutdown; None when NVML is absent or fails."""
    try:
        import pynvml  # noqa: WPS433 - optional dependency (nvidia-ml-py)
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, or no driver behind it
        return None
    try:
        return read(pynvml)
    except Exception:  # noqa: BLE001 - a broken NVML is asked no further: nvidia-smi may still answer
        return None
    finally:
        pynvml.nvmlShutdown()


def _smi_gpu(f):
    return {"index": _number(f[0]), "name": f[1], "uuid": f[2], "memory_total_mib": _number(f[3]),
            "memory_used_mib": _number(f[4]), "memory_free_mib": _number(f[5]), "driver_version": f[6]}


def gpus():
    """GPUs of this host through NVML (nvidia-ml-py) when installed, else nvidia-smi, else ([], None):
    ``(list, source)``. Each GPU: index, minor (its /dev/nvidia<minor>, from the driver's files; None
    when unread), name (its model), uuid, memory total/used/free in MiB (None
    where not reported), driver_version."""
    found, source = _with_nvml(_nvml_gpus), "nvml"
    if found is None:
        rows, source = _smi_rows("gpu", GPU_FIELDS), "nvidia-smi"
        if rows is None:
            return [], None
        found = [_smi_gpu(f) for f in rows]
    minors = {g["uuid"]: g["minor"] for g in devices.inventory()}
    for gpu in found:
        gpu["minor"] = minors.get(gpu["uuid"])
    return found, source


def _nvml_apps(pynvml):
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = _text(pynvml.nvmlDeviceGetUUID(h))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            # usedGpuMemory is None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE): unknown, not 0
            out.append({"pid": int(proc.pid), "gpu_uuid": uuid, "bytes": proc.usedGpuMemory})
    return out


def compute_apps():
    """The GPU memory each CUDA process holds on each GPU: ``([{"pid", "gpu_uuid", "bytes"}], source)``
    from NVML, else nvidia-smi; ``(None, None)`` when neither can be asked (unknown: not "none")."""
    found = _with_nvml(_nvml_apps)
    if found is not None:
        return found, "nvml"
    rows = _smi_rows("compute-apps", APP_FIELDS)
    if rows is None:
        return None, None
    out = []
    for f in rows:
        mib = _number(f[2])
        out.append({"pid": _number(f[0]), "gpu_uuid": f[1], "bytes": mib * MIB if mib is not None else None})
    return out, "nvidia-smi"


def gpu_memory_by_pid():
    """``({pid: bytes of GPU memory, None where not reported}, source)``, summed over the GPUs a process
    holds; ``(None, None)`` when neither NVML nor nvidia-smi can be asked."""
    apps, source = compute_apps()
    if apps is None:
        return None, None
    out = {}
    for app in apps:
        known = out.get(app["pid"], 0)
        out[app["pid"]] = None if known is None or app["bytes"] is None else known + app["bytes"]
    return out, source


def driver_version():
    """The kernel driver's version string (e.g. 580.159.04), or None."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9.]+)", fh.read())
            return m.group(1) if m else None
    except OSError:
        return None
