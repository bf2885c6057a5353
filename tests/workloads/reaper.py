"""Run a command that daemonizes itself (double fork, prints its pid) under a child subreaper that
reaps the daemon the moment it exits, as systemd or a container shim does for real workloads.

Without it the daemon is reparented to PID 1, and PID 1 of the GPU machine's VM (and of this CI
kind) reaps about a second late. When source and target are one pid space, a restore must wait for
the dumped workload's zombies to be reaped before CRIU can reuse their pids: that wait is an artifact
of such an init, not of the migration, and the benchmark would count it as downtime.

  reaper.py COMMAND [ARG...]     # prints what COMMAND printed, returns when COMMAND returns
"""
import ctypes
import os
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main():
    r, w = os.pipe()
    if os.fork() > 0:  # the caller's side: relay what the command printed, then return
        os.close(w)
        out = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
        sys.stdout.write(out.decode())
        return 0
    os.close(r)
    os.setsid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    rc = subprocess.call(sys.argv[1:], stdin=devnull, stdout=w, stderr=w)
    os.close(w)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # the caller's ssh session ends now; the daemon lives on below this process
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
