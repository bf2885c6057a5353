# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Before the freeze: the workload shrinks what must be saved (``quiesce_signal``, ``quiesce_command``).

A PyTorch job's caching allocator can hold far more GPU memory than its live tensors (a job with
about 8.5 GB of tensors made a 41.6 GB image, docs/benchmarks), and every byte of it is copied to host
memory, dumped, sent and restored. The workload can give it back first; it runs on while it does, so
this costs no downtime. Two ways:

- ``quiesce_signal``: a signal sent to each CUDA process (the root process when none), which the
  workload handles by releasing what it can and writing an acknowledgement,
  ``/tmp/gpuckpt-quiesced.<its own pid>``, in its own root (tools/gpuckpt_quiesce.py does both for a
  PyTorch job: ``torch.cuda.empty_cache()``). A process that does not catch the signal is refused
  before anything is sent (its default action would kill or stop it). Without an acknowledgement
  within ``quiesce_timeout`` the checkpoint goes on with what is there, and says so.
- ``quiesce_command``: a command run inside the workload like the restore's probe (its namespaces,
  root, working directory and environment), e.g. a call to an inference server's own endpoint. A
  failure fails the checkpoint before the freeze: nothing is frozen, and the command's effect is the
  workload's to undo.

The acknowledgement is read through /proc/<pid>/root without following a symlink and without
blocking on a fifo: the workload writes it, so it is not trusted beyond its own JSON. Once read, it is
removed (a regular file only): it answers one checkpoint, and nothing of one stays in the workload's /tmp.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import time

from ..core.errors import GpuCkptError, InvalidTarget
from ..core.fsutil import UnsafePath, open_beneath, remove_regular_file
from ..core.wait import wait_for
from ..runtimes.base import ns_pid

ACK = "tmp/gpuckpt-quiesced.%d"
# Signals a workload cannot catch, or that would stop or continue it instead of asking it.
REFUSED = ("SIGKILL", "SIGSTOP", "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU")


def signal_number(value):
    """A signal given as SIGUSR1, USR1 or 10: (number, name). Raises InvalidTarget."""
    text = str(value).strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise InvalidTarget("quiesce_signal %r is not a signal; nothing was frozen" % (value,), stage="preflight")
    if sig.name in REFUSED:
        raise InvalidTarget("quiesce_signal %s cannot ask a workload to quiesce (it cannot be caught, or it stops or "
                            "continues the process); nothing was frozen" % sig.name, stage="preflight",
                            hint="use a signal the workload handles, such as SIGUSR1")
    return int(sig), sig.name


def catches(pid, signum):
    """Whether ``pid`` has a handler for ``signum`` (its SigCgt mask), or None when it is gone."""
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_caught(pids, signum, name):
    """Refuse, before anything is sent, processes that would die or stop from the signal."""
    not_caught = [p for p in pids if not catches(p, signum)]
    if not_caught:
        raise InvalidTarget("process(es) %s do not handle %s: sending it would kill or stop them; nothing was sent "
                            "and nothing was frozen" % (", ".join(map(str, not_caught)), name), stage="preflight",
                            pid=not_caught[0],
                            hint="install the handler in the workload (tools/gpuckpt_quiesce.py), or drop "
                                 "quiesce_signal")


def read_ack(pid):
    """The acknowledgement ``pid`` wrote (a dict), or None."""
    inner = ns_pid(pid) or pid
    try:
        root = os.open("/proc/%d/root" % pid, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd = open_beneath(root, ACK % inner, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, UnsafePath):
        return None
    finally:
        os.close(root)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        ack = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return ack if isinstance(ack, dict) else None


def remove_ack(pid):
    """Remove the acknowledgement ``pid`` wrote for this checkpoint, once read: it is written for one
    checkpoint only, and a bare process writes it in the host's own /tmp. Only a regular file there is
    removed, through /proc/<pid>/root, following no symlink on the way. True when one was removed."""
    inner = ns_pid(pid) or pid
    rel = ACK % inner
    try:
        root = os.open("/proc/%d/root" % pid, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        parent = open_beneath(root, os.path.dirname(rel), os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, UnsafePath):
        return False
    finally:
        os.close(root)
    try:
        return remove_regular_file(parent, os.path.basename(rel))
    finally:
        os.close(parent)


def by_signal(pids, signum, name, timeout, poll=0.02):
    """Send the signal to each of ``pids`` and wait (at most ``timeout`` s) for each one's new
    acknowledgement. Returns the report; never raises for a missing acknowledgement."""
    started = time.monotonic()
    before = {p: read_ack(p) for p in pids}
    for p in pids:
        try:
            os.kill(p, signum)
        except ProcessLookupError:
            raise GpuCkptError("process %d went away before it could be asked to quiesce; nothing was frozen" % p,
                               stage="quiesce", pid=p)
    acked = {}

    def all_acknowledged():
        for p in pids:
            if p not in acked:
                ack = read_ack(p)
                if ack is not None and ack != before[p]:
                    acked[p] = ack
        return len(acked) == len(pids)

    # (the deadline counts from before the signals went, as the timeout says)
    wait_for(all_acknowledged, max(0.0, timeout - (time.monotonic() - started)),
             "the acknowledgement of %s by %s" % (name, ", ".join(map(str, pids))), interval=poll,
             on_timeout="return")
    report = {"signal": name, "pids": list(pids), "seconds": round(time.monotonic() - started, 3),
              "acknowledged": {str(p): acked[p] for p in acked}}
    for p in acked:  # read: nothing of this checkpoint stays in the workload's /tmp
        remove_ack(p)
    missing = [p for p in pids if p not in acked]
    if missing:
        report["not_acknowledged"] = missing
        report["warning"] = ("process(es) %s did not acknowledge %s within %ss; checkpointed as they were"
                             % (", ".join(map(str, missing)), name, timeout))
    return report


def by_command(backend, root_pid, argv, timeout):
    """Run the user's quiesce command inside the workload; a failure fails the checkpoint before the freeze."""
    started = time.monotonic()
    res = backend.probe(root_pid, argv, timeout, stage="quiesce")
    out = {"cmd": list(argv), "rc": res.rc, "seconds": round(time.monotonic() - started, 3),
           "stdout": res.stdout[-2000:], "stderr": res.stderr[-2000:]}
    if res.rc != 0:
        raise GpuCkptError("the quiesce command %s exited with rc=%d inside the workload (root pid %d); nothing was "
                           "frozen" % (" ".join(argv), res.rc, root_pid), stage="quiesce", pid=root_pid,
                           cmd=list(argv), rc=res.rc, stdout=out["stdout"], stderr=out["stderr"],
                           hint="the command runs in the workload's namespaces, root and environment, like an exec; "
                                "whatever it changed in the workload is still changed")
    return out
