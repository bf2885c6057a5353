# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The cooperative checkpoint of a distributed job (``quiesce_mode: cooperative``, issue 45 part 2).

A job in NCCL's default configuration (P2P over NVLink through cuMem) cannot be restored by the driver while its
communicators live. The job can let them go, though: tools/gpuckpt_quiesce.py's ``Cooperative`` (two lines of a
torchrun script) brings every rank to the same step boundary, destroys its process groups and waits. The protocol,
through each rank's own /tmp (read and written through /proc/<pid>/root, never following a symlink):

1. request: ``gpuckpt-request.<pid>`` ({"request": N, "lease_s": L}) written to every rank first, then the signal
   (SIGUSR1 unless ``quiesce_signal`` says otherwise) sent to each. N grows with time: a rank ignores a number it has
   already handled.
2. the ranks agree (a one-number all-reduce, MAX, at their step boundaries), release their communicators and
   acknowledge: ``gpuckpt-quiesced.<pid>`` ({"request": N, "step", "rank", "released": true}). Every rank within
   ``quiesce_timeout``, all at the same step, none of them still mapping NCCL's shared memory: else nothing is
   frozen, every rank is told to resume (step 4) and the error names the rank.
3. the engine's order as ever: lock all, checkpoint all, dump; (leave_running) restore all, unlock all.
4. resume: ``gpuckpt-resume.<pid>`` ({"request": N}) to every rank, after leave_running's unlock, after gpu_restore's
   unlock, when the checkpoint fails (its undo), or from the give-back of a checkpoint whose holder died
   (give_back.py). Each rank re-creates its process group on a fresh prefix of the rendezvous store it kept.
   Should the resume never come, a rank that runs again resumes by itself once it has waited ``lease_s`` seconds
   of its own running time (time it spent frozen, or a restore's clock jump, does not count).
"""
from __future__ import annotations

import json
import os
import stat
import time

from ..core import procfs
from ..core.errors import GpuCkptError
from ..core.fsutil import UnsafePath, open_beneath, remove_regular_file
from ..core.journal import process_identity, same_process
from ..core.wait import wait_for
from . import quiesce

ANNOUNCE = "gpuckpt-cooperative.%d"
REQUEST = "gpuckpt-request.%d"
RESUME = "gpuckpt-resume.%d"
ACK = "gpuckpt-quiesced.%d"
MODES = ("release", "cooperative", "auto")


def request_number():
    """A new request's number: milliseconds since the epoch (a rank ignores numbers it has handled)."""
    return int(time.time() * 1000)


def _tmp_dir(pid):
    """An fd of the process's /tmp (through /proc/<pid>/root, no symlink followed), or None."""
    try:
        root = os.open("/proc/%d/root" % pid, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return open_beneath(root, "tmp", os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, UnsafePath):
        return None
    finally:
        os.close(root)


def _owner(pid):
    try:
        st = os.stat("/proc/%d" % pid)
        return st.st_uid, st.st_gid
    except OSError:
        return None


def _name(pid, pattern):
    return pattern % (procfs.ns_pid(pid) or pid)


def write_file(pid, pattern, doc):
    """Write ``doc`` (JSON) as the file ``pattern`` % (its own pid) in the process's /tmp, atomically, owned by the
    process's user (who must read and remove it). True when written."""
    owner, name = _owner(pid), _name(pid, pattern)
    tmp_fd = _tmp_dir(pid)
    if tmp_fd is None or owner is None:
        return False
    tmp = ".%s.%s.tmp" % (name, os.urandom(6).hex())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=tmp_fd)
        try:
            os.write(fd, json.dumps(doc).encode("utf-8"))
            os.fchown(fd, *owner)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=tmp_fd)
        return True
    except OSError:
        try:
            os.unlink(tmp, dir_fd=tmp_fd)
        except OSError:
            pass
        return False
    finally:
        os.close(tmp_fd)


def remove_file(pid, pattern):
    """Remove the regular file ``pattern`` % (its own pid) from the process's /tmp. True when removed."""
    tmp_fd = _tmp_dir(pid)
    if tmp_fd is None:
        return False
    try:
        return remove_regular_file(tmp_fd, _name(pid, pattern))
    finally:
        os.close(tmp_fd)


def announced(pids):
    """The pids among ``pids`` whose process announced the helper (``gpuckpt-cooperative.<pid>`` in its /tmp, written
    by Cooperative()): ``quiesce_mode: auto`` checkpoints such a tree cooperatively."""
    out = []
    for p in pids:
        tmp_fd = _tmp_dir(p)
        if tmp_fd is None:
            continue
        try:
            if stat.S_ISREG(os.stat(_name(p, ANNOUNCE), dir_fd=tmp_fd, follow_symlinks=False).st_mode):
                out.append(p)
        except OSError:
            pass
        finally:
            os.close(tmp_fd)
    return out


def rank_name(pid, env=None):
    """"rank R (pid P)" as the process's environment says (torchrun's RANK), or "pid P"."""
    env = procfs.environ(pid) if env is None else env
    return "rank %s (pid %d)" % (env["RANK"], pid) if env.get("RANK") not in (None, "") else "pid %d" % pid


def resume(pids, number):
    """Tell every rank of ``pids`` to resume from request ``number`` (its request file goes too). Returns the pids
    told; one that is gone is skipped."""
    told = []
    for p in pids:
        remove_file(p, REQUEST)
        if write_file(p, RESUME, {"request": number, "resumed_at": time.time()}):
            told.append(p)
    return told


def _failed(pids, number, msg, pid, hint=None):
    """Tell every rank to resume, then the error (the checkpoint froze nothing)."""
    told = resume(pids, number)
    return GpuCkptError("%s; nothing was frozen, and every rank was told to resume (%s)"
                        % (msg, ", ".join(map(str, told)) or "none left"), stage="quiesce", pid=pid,
                        hint=hint or "a rank answers at its next step boundary (Cooperative.step_boundary): a step "
                                     "longer than quiesce_timeout, or a rank stuck in a call, cannot answer in time")


def _clear_stale(pids):
    for p in pids:
        remove_file(p, RESUME)
        quiesce.remove_ack(p)


def _send_requests(pids, signum, lease, number):
    """Write every rank's request, then signal each: every request is written before any signal, so that a rank
    the others carry to the boundary finds its own there."""
    for p in pids:
        if not write_file(p, REQUEST, {"request": number, "lease_s": lease, "asked_at": time.time()}):
            raise _failed(pids, number, "%s could not be asked (its /tmp cannot be written)" % rank_name(p), p)
    for p in pids:
        try:
            os.kill(p, signum)
        except ProcessLookupError:
            raise _failed(pids, number, "%s went away before it could be asked" % rank_name(p), p)


def _gather_acks(pids, idents, number, timeout, poll):
    """Wait, at most ``timeout`` s, until every rank acknowledged request ``number`` having released its
    communicators, or one is gone. Returns (acked, waiting): by pid, the acknowledgements of the ranks that
    released, and of those at their boundary still waiting for the others. Their ack files are removed."""
    acked, waiting = {}, {}

    def all_acknowledged():
        for p in pids:
            if p not in acked:
                ack = quiesce.read_ack(p)
                if ack is not None and ack.get("request") == number:
                    if ack.get("released"):
                        acked[p] = ack
                    else:  # at its boundary, waiting for the others to get there
                        waiting[p] = ack
        return len(acked) == len(pids) or any(not same_process(idents[p]) for p in pids if p not in acked)

    wait_for(all_acknowledged, max(0.0, timeout), "the acknowledgements of request %d" % number, interval=poll,
             on_timeout="return")
    for p in set(acked) | set(waiting):
        quiesce.remove_ack(p)
    return acked, waiting


def _unacknowledged(pids, idents, number, timeout, missing, acked, waiting):
    """The error for ranks that did not acknowledge: the first one gone, else those that never reached their
    boundary (the ranks there wait for them)."""
    gone = [p for p in missing if not same_process(idents[p])]
    if gone:
        return _failed(pids, number, "%s exited before it acknowledged" % rank_name(gone[0]), gone[0])
    late = [p for p in missing if p not in waiting] or missing  # (those at their boundary wait for these)
    there = [p for p in pids if p in waiting or p in acked]
    return _failed(pids, number, "%s did not reach its step boundary and acknowledge the cooperative checkpoint "
                   "within %ss (%s)" % (", ".join(rank_name(p) for p in late), timeout,
                                        "%s waited there for it" % ", ".join(rank_name(p) for p in there)
                                        if there else "no rank acknowledged"), late[0])


def _judge_acks(pids, idents, number, timeout, acked, waiting):
    """Raises GpuCkptError (every rank told to resume) unless every rank acknowledged, at one step, with its
    communicators released. Returns the step, by pid."""
    missing = [p for p in pids if p not in acked]
    if missing:
        raise _unacknowledged(pids, idents, number, timeout, missing, acked, waiting)
    steps = {p: acked[p].get("step") for p in pids}
    if len(set(map(str, steps.values()))) > 1:
        raise _failed(pids, number, "the ranks stopped at different steps (%s)"
                      % ", ".join("%s: %s" % (rank_name(p), s) for p, s in sorted(steps.items())), pids[0])
    kept = [p for p in pids if not acked[p].get("released")]
    if kept:
        raise _failed(pids, number, "%s acknowledged without releasing its communicators" % rank_name(kept[0]), kept[0])
    return steps


def ask(pids, signum, name, timeout, lease, number, poll=0.02):
    """Ask the ranks ``pids`` to release their communicators at one step boundary (request ``number``), and wait
    (at most ``timeout`` s) for every acknowledgement. Returns the report. Raises GpuCkptError, every rank told to
    resume, when one is gone, does not answer in time, or answers at another step."""
    started = time.monotonic()
    idents = {p: process_identity(p) for p in pids}
    _clear_stale(pids)
    _send_requests(pids, signum, lease, number)
    acked, waiting = _gather_acks(pids, idents, number, timeout - (time.monotonic() - started), poll)
    steps = _judge_acks(pids, idents, number, timeout, acked, waiting)
    return {"mode": "cooperative", "signal": name, "request": number, "lease_s": lease,
            "step": steps[pids[0]], "seconds": round(time.monotonic() - started, 3),
            "ranks": {str(p): {k: acked[p].get(k) for k in ("rank", "step", "seconds", "backend")} for p in pids},
            "identities": {str(p): idents[p] for p in pids}}


def check_released(report, live_nccl):
    """After every acknowledgement and before the freeze: each rank is still the process that acknowledged, and
    none still holds live NCCL communicators (``live_nccl(pid)``: what /proc shows). Raises GpuCkptError (every
    rank told to resume) naming the rank."""
    pids = [int(p) for p in report["ranks"]]
    for p in pids:
        if not same_process(report["identities"][str(p)]):
            raise _failed(pids, report["request"], "%s exited after it acknowledged, before the freeze"
                          % _acked_name(report, p),
                          p, hint="the job lost a rank; its launcher decides what becomes of the others")
    for p in pids:
        if live_nccl(p):
            raise _failed(pids, report["request"], "%s acknowledged, but still maps NCCL's shared memory (a "
                          "communicator the job did not destroy, e.g. a process group of its own)" % rank_name(p), p,
                          hint="destroy every process group at the boundary (Cooperative does: "
                               "torch.distributed.destroy_process_group())")


def _acked_name(report, pid):
    rank = ((report.get("ranks") or {}).get(str(pid)) or {}).get("rank")
    return "rank %s (pid %d)" % (rank, pid) if rank is not None else "pid %d" % pid


def check_alive(report, pid):
    """Before the lock of ``pid``: a rank that acknowledged and exited since fails the checkpoint (its undo unlocks
    what was locked and tells the other ranks to resume), naming the rank."""
    ident = (report.get("identities") or {}).get(str(pid))
    if ident is not None and not same_process(ident):
        raise GpuCkptError("%s exited after it acknowledged request %d, before it was frozen; the ranks locked so far "
                           "are unlocked and every rank left is told to resume"
                           % (_acked_name(report, pid), report["request"]),
                           stage="cuda_lock", pid=pid,
                           hint="the job lost a rank; its launcher decides what becomes of the others")


def record_of(report):
    """What a manifest or a give-back record keeps of the request: enough to tell the ranks to resume."""
    if not report or report.get("mode") != "cooperative":  # (a plain quiesce's report: nothing to resume)
        return None
    return {"request": report["request"], "step": report.get("step"), "lease_s": report.get("lease_s"),
            "ranks": {p: r.get("rank") for p, r in (report.get("ranks") or {}).items()}}


def resume_restored(coop, old_pids, new_pids):
    """After a restore: tell the restored ranks (their new host pids, ``new_pids`` in the order of ``old_pids``) to
    resume. Returns the pids told."""
    if not coop:
        return []
    mapping = dict(zip(old_pids, new_pids)) if len(old_pids) == len(new_pids) else {}
    return resume([mapping.get(int(p), int(p)) for p in coop.get("ranks") or {}], coop["request"])
