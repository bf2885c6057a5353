"""Facts about the real driver that the engine and the libcuda test double rely on: what
GetState answers for a pid that is not a CUDA process, and what a scan of every pid costs."""
import ctypes
import json
import os
import time

lib = ctypes.CDLL("libcuda.so.1")
print("cuInit", lib.cuInit(0))
v = ctypes.c_int()
lib.cuDriverGetVersion(ctypes.byref(v))


def name(code):
    p = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(p))
    value = p.value
    return value.decode() if value is not None else str(code)


out = {"api_version": v.value}
st = ctypes.c_int(-1)
for label, pid in (("self", os.getpid()), ("init", 1), ("missing", 4194303)):
    rc = lib.cuCheckpointProcessGetState(pid, ctypes.byref(st))
    out["getstate_" + label] = name(rc)
pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
t = time.perf_counter()
for p in pids:
    lib.cuCheckpointProcessGetState(p, ctypes.byref(st))
out["scan_pids"] = len(pids)
out["scan_seconds"] = round(time.perf_counter() - t, 6)
print(json.dumps(out))
