"""PID 1 of a test host's pid namespace: starts the host's sshd and reaps every orphan at once
(a workload restored there is reparented to us; a slow reaper would hold its pids)."""
import os
import signal
import subprocess
import sys

# The host's own shell profile (LoopbackHosts writes it), bound over root's ~/.bashrc in this host's mount
# namespace: bash reads ~/.bashrc for every command ssh runs, and this machine's runs `pyenv init`, a rehash of
# about 0.3 s per Ansible task (a crash mid-rehash leaves pyenv's lock behind, and every later login waits 60 s
# on it). A fleet node has no such profile.
profile, bashrc = os.environ.pop("GPUCKPT_HOST_SHELL_PROFILE", ""), os.path.expanduser("~/.bashrc")
if profile and os.path.isfile(bashrc):
    subprocess.run(["mount", "--bind", profile, bashrc], check=True)
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
