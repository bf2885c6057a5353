# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The CUDA driver's checkpoint API (CUDA 12.8+/driver 570+) through ctypes on libcuda.so.1.

We call the driver directly instead of the cuda-checkpoint binary: it is a thin shim over the same
entry points, is absent on most hosts, and one in-process call avoids a fork+exec per pid per step.
Layouts (all Args structs are 64 bytes, checked on import below):
  LockArgs       {uint32 timeoutMs; uint32 reserved0; uint64 reserved1[7]}
  Checkpoint/Unlock args: uint64 reserved[8] (NULL accepted)
  RestoreArgs    {CUcheckpointGpuPair *gpuPairs; uint32 gpuPairsCount; char reserved[44]; uint64 reserved1}
  GpuPair        {CUuuid oldUuid; CUuuid newUuid}  (16 bytes each)
The library path can be overridden with GPUCKPT_LIBCUDA (the CI stand-in uses this).
"""
from __future__ import annotations

import ctypes
import os
import time

from ..core.errors import DriverError, DriverUnavailable

# What cuCheckpointProcessGetState answers, by name (cuda_state() reports these).
STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed", 4: "checkpointing", 5: "restoring"}

# Fallback names for when cuGetErrorName is unusable; the driver's own names win when present.
ERROR_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT", 304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED", 802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 909: "CUDA_ERROR_TIMEOUT", 999: "CUDA_ERROR_UNKNOWN",
}
CUDA_ERROR_NOT_SUPPORTED = 801  # seen on driver 580.159.04 for a process with managed (UVM) memory
# What GetState answers for a pid that is not a CUDA process (driver 580.159.04, measured): a live
# process without CUDA -> NOT_INITIALIZED; a pid that does not exist -> OPERATING_SYSTEM.
NOT_A_CUDA_PROCESS = (3, 304, 500)

CHECKPOINT_SYMBOLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                      "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                      "cuCheckpointProcessGetRestoreThreadId")
# cuDriverGetVersion reports the CUDA API version: 12080 = CUDA 12.8 (driver 570), 13000 = CUDA 13.0 (580).
MIN_API_VERSION = 12080
GPU_REMAP_API_VERSION = 13000


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint32), ("reserved0", ctypes.c_uint32),
                ("reserved1", ctypes.c_uint64 * 7)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint32),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


if not (ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_RestoreArgs) == 64 and ctypes.sizeof(_GpuPair) == 32):
    raise AssertionError("the driver's checkpoint argument structs must be 64 bytes (pairs 32)")


def format_uuid(raw):
    """16 raw bytes -> 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (nvidia-smi's form)."""
    h = bytes(raw).hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])


def parse_uuid(text):
    h = text.strip().lower()
    if h.startswith("gpu-"):
        h = h[4:]
    h = h.replace("-", "")
    if len(h) != 32:
        raise ValueError("not a GPU UUID: %r" % text)
    return bytes.fromhex(h)


def api_version_string(v):
    return "%d.%d" % (v // 1000, (v % 1000) // 10) if v else None


def unsupported_hint(code):
    """What to tell the user about a driver error ``code`` that says the process cannot be checkpointed."""
    if code == CUDA_ERROR_NOT_SUPPORTED:
        return ("the driver cannot checkpoint this process: it uses something the checkpoint API does "
                "not support (managed/UVM memory, CUDA IPC memory, NCCL, MPS or MIG)")
    return None


class StateQueries(object):
    """What every way of reaching the driver answers from ``get_state(pid)`` (a state number, or a
    DriverError): the in-process driver below, and a sandbox's tool (runtimes/runsc.py)."""

    def get_state(self, pid):
        raise NotImplementedError

    def cuda_state(self, pid):
        """State name of ``pid``, or None when it is not a CUDA process. Any process that called
        cuInit counts, even without a context (the driver says so; so does this controller itself).
        Other driver errors are raised: a GPU process must never be mistaken for a CPU one."""
        try:
            return STATE_NAMES.get(self.get_state(pid), "unknown")
        except DriverError as exc:
            if exc.code in NOT_A_CUDA_PROCESS:
                return None
            raise

    def state_or_error(self, pid):
        """For reports: the state name, None when not a CUDA process, or the driver's error name."""
        try:
            return self.cuda_state(pid)
        except DriverError as exc:
            return exc.name


class CudaDriver(StateQueries):
    """One loaded libcuda.so.1. Every call is timed into ``self.calls`` for the benchmarks."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("GPUCKPT_LIBCUDA") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise DriverUnavailable(
                "cannot load the NVIDIA driver library %s: %s" % (self.path, exc), stage="preflight",
                hint="install the NVIDIA driver (570 or newer), or run where a GPU is present")
        missing = [s for s in CHECKPOINT_SYMBOLS if not hasattr(self.lib, s)]
        if missing:
            raise DriverUnavailable(
                "%s has no %s: the driver is older than 570 and lacks the checkpoint API"
                % (self.path, ", ".join(missing)), stage="preflight",
                hint="upgrade the NVIDIA driver to 570 or newer (580+ to restore onto other GPUs)")
        self.calls = []
        for name in CHECKPOINT_SYMBOLS:
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.cuInit.restype = ctypes.c_int
        # cuInit must have run in the calling process before the checkpoint calls work.
        self.init_result = self.lib.cuInit(0)
        v = ctypes.c_int(0)
        self.api_version = v.value if self.lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
        if 0 < self.api_version < MIN_API_VERSION:  # the symbols exist, but not the API they name there
            raise DriverUnavailable(
                "%s reports CUDA API %s, older than %s (driver 570), the first with the checkpoint API"
                % (self.path, api_version_string(self.api_version), api_version_string(MIN_API_VERSION)),
                stage="preflight", hint="upgrade the NVIDIA driver to 570 or newer (580+ to restore onto other GPUs)")
        self.path_resolved = self._resolved_path()

    def _resolved_path(self):
        try:
            with open("/proc/self/maps") as fh:
                for line in fh:
                    if "libcuda" in line and "/" in line:
                        return line.split(None, 5)[-1].strip()
        except OSError:
            pass
        return self.path

    # -- error handling -------------------------------------------------------------------------
    def error_name(self, code):
        try:
            p = ctypes.c_char_p()
            if self.lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(p)) == 0 and p.value:
                return p.value.decode()
        except (AttributeError, OSError):
            pass
        return ERROR_NAMES.get(code, "CUDA_ERROR_%d" % code)

    def _call(self, name, pid, *args, **kw):
        fn = getattr(self.lib, name)
        start = time.monotonic()
        code = fn(ctypes.c_int(pid), *args)
        secs = time.monotonic() - start
        self.calls.append({"call": name, "pid": pid, "seconds": secs, "rc": code})
        if code != 0:
            hint = unsupported_hint(code) or kw.get("hint")
            raise DriverError(name, code, self.error_name(code), pid=pid, stage=kw.get("stage"), hint=hint)
        return secs

    # -- the checkpoint API ----------------------------------------------------------------------
    def get_state(self, pid):
        st = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(st))
        return st.value

    def lock(self, pid, timeout_ms=30000):
        args = _LockArgs(timeoutMs=int(timeout_ms))
        return self._call("cuCheckpointProcessLock", pid, ctypes.byref(args), stage="lock")

    def checkpoint(self, pid):
        return self._call("cuCheckpointProcessCheckpoint", pid, None, stage="checkpoint")

    def restore(self, pid, gpu_pairs=None):
        """``gpu_pairs``: list of (old_uuid, new_uuid) strings; needs CUDA 13.0 / driver 580+."""
        if not gpu_pairs:
            return self._call("cuCheckpointProcessRestore", pid, None, stage="cuda-restore")
        if self.api_version < GPU_REMAP_API_VERSION:
            raise DriverUnavailable(
                "restoring onto other GPUs needs driver 580+ (CUDA 13.0 API); this driver reports CUDA %s"
                % api_version_string(self.api_version), stage="cuda-restore", pid=pid,
                hint="restore without gpu_map, or upgrade the driver on this host")
        arr = (_GpuPair * len(gpu_pairs))()
        for i, (old, new) in enumerate(gpu_pairs):
            arr[i].oldUuid.bytes[:] = list(parse_uuid(old))
            arr[i].newUuid.bytes[:] = list(parse_uuid(new))
        args = _RestoreArgs(gpuPairs=ctypes.cast(arr, ctypes.POINTER(_GpuPair)), gpuPairsCount=len(gpu_pairs))
        return self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args), stage="cuda-restore")

    def unlock(self, pid):
        return self._call("cuCheckpointProcessUnlock", pid, None, stage="unlock")

    # -- devices ---------------------------------------------------------------------------------
    def device_uuids(self):
        """UUIDs of the GPUs visible to CUDA in this process, in CUDA order ([] when none)."""
        if self.init_result != 0:
            return []
        n = ctypes.c_int(0)
        if self.lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return []
        get_uuid = getattr(self.lib, "cuDeviceGetUuid_v2", None) or getattr(self.lib, "cuDeviceGetUuid", None)
        out = []
        for i in range(n.value):
            dev = ctypes.c_int(0)
            u = _Uuid()
            if self.lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and get_uuid(ctypes.byref(u), dev) == 0:
                out.append(format_uuid(u.bytes))
        return out

    def info(self):
        return {"library": self.path_resolved, "api_version": api_version_string(self.api_version),
                "checkpoint_api": True, "gpu_remap": self.api_version >= GPU_REMAP_API_VERSION,
                "init": self.error_name(self.init_result) if self.init_result else "CUDA_SUCCESS"}


def load(path=None):
    """Load the driver, or return (None, reason) when it cannot serve."""
    try:
        return CudaDriver(path), None
    except DriverUnavailable as exc:
        return None, exc
