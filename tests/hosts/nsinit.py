"""PID 1 of a test host's pid namespace: starts the host's sshd and reaps every orphan at once
(a workload restored there is reparented to us; a slow reaper would hold its pids)."""
import os
import signal
import subprocess
import sys

child = subprocess.Popen(sys.argv[1:])


def _stop(signum, frame):
    child.terminate()
    os._exit(0)


signal.signal(signal.SIGTERM, _stop)
while True:
    try:
        pid, _status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    # sshd's end is not the host's: a host cut off from the network (LoopbackHosts.cut_off) still runs its
    # workloads, and a new sshd started in this namespace (reconnect) is reparented to us.
