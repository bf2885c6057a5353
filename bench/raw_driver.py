"""The floor for stage 1: the driver's checkpoint calls alone, timed with nothing around them.

Deliberately independent of the engine (plain ctypes, no gpuckpt import), so that the engine's
stage timings can be compared with what the driver itself takes, in the same run.

  raw_driver.py PID [PID...] [--cycles N]   -> JSON lines, one per cycle:
      {"lock": s, "checkpoint": s, "restore": s, "unlock": s}
"""
import argparse
import ctypes
import json
import time


class Args64(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint32), ("reserved0", ctypes.c_uint32), ("reserved1", ctypes.c_uint64 * 7)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pids", type=int, nargs="+")
    ap.add_argument("--cycles", type=int, default=1)
    ap.add_argument("--lib", default="libcuda.so.1")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    assert lib.cuInit(0) == 0
    lock_args = Args64(timeoutMs=30000)

    def timed(fn, *a):
        t = time.perf_counter()
        rc = fn(*a)
        if rc != 0:
            raise SystemExit("%s%r returned %d" % (fn.__name__, a[:1], rc))
        return time.perf_counter() - t

    for unused in range(args.cycles):
        out = {"lock": 0.0, "checkpoint": 0.0, "restore": 0.0, "unlock": 0.0}
        for p in args.pids:
            out["lock"] += timed(lib.cuCheckpointProcessLock, p, ctypes.byref(lock_args))
        for p in args.pids:
            out["checkpoint"] += timed(lib.cuCheckpointProcessCheckpoint, p, None)
        for p in args.pids:
            out["restore"] += timed(lib.cuCheckpointProcessRestore, p, None)
        for p in args.pids:
            out["unlock"] += timed(lib.cuCheckpointProcessUnlock, p, None)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
