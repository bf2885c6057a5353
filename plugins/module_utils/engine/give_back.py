# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A checkpoint whose holder died, its workload given back.

A checkpoint that leaves its workload running (leave_running: a protected job's periodic checkpoint) keeps a
record while it runs: a journal (core/journal.py) whose phase says how far it got, with the pids, CUDA pids,
identities and states it froze, its image dir, and the flock of the process that holds the workload. Whoever
holds a job frozen can die between the CUDA lock and the unlock: its tree SIGKILLed, the OOM killer, systemd
stopping its unit past TimeoutStopSec. The kernel then drops the flock, the record stays in a phase short of
``resumed``, and the job stays locked or checkpointed in the driver: it never runs again by itself.

``give_back`` is what the next operation on the node runs first (the protect timer, facts, status, drain and an
operator's ``gpuckpt-protect give-back``). It takes the record's lock without waiting (a live holder keeps it:
nothing is touched), and gives the workload back as the checkpoint's own undo would have: SIGCONT (the runtime's
resume: a container its dump paused is thawed) to what was not stopped before, then the driver's restore of
every CUDA pid still checkpointed and the unlock of every one still locked, all restored before any is
unlocked; a partial image (no manifest) is removed. Only processes that are still the checkpointed ones (pid,
start time, boot) are touched: a pid reused since is not ours. A workload none of whose processes is left is not
brought back from an image: it was left running, so something else ended it (the node's fence, its owner).

A cooperative job (engine/cooperative.py) is also told to resume, once the GPU is its own again: its ranks wait at
their step boundary for that word. gpu_checkpoint keeps such a record for a cooperative leave_running checkpoint
(``hold_dir``, ``held_run``) and gives back what a dead one left before anything else (``give_back_all``).

Only records of checkpoints that left the workload running are given back here: a migration's source
(left stopped, or exited) is settled by its migration's rules (migration/transaction.py, recover.yml).
"""
from __future__ import annotations

import os
import uuid

from ..core import image, procfs
from ..core.errors import GpuCkptError
from ..core.journal import TERMINAL, Journal, JournalBusy, alive_pids
from .held import resume_stopped
from .steps import now_iso

RECORD_SUFFIX = ".source.json"
MODULE_PREFIX = "checkpoint-"  # (gpu_checkpoint's own records; the protect runner's have theirs)


def records(journal_dir, prefix=""):
    """The ids of the records in ``journal_dir`` whose id starts with ``prefix``, oldest first."""
    try:
        names = os.listdir(journal_dir)
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(prefix) and name.endswith(RECORD_SUFFIX):
            path = os.path.join(journal_dir, name)
            try:
                found.append((os.lstat(path).st_mtime, name[:-len(RECORD_SUFFIX)]))
            except OSError:
                continue
    return [rid for unused, rid in sorted(found)]


def forget(journal):
    """Remove a finished record's files (its document, lock and fence): a periodic checkpoint keeps none."""
    for path in (journal.path, journal.fence_path, journal.lock_path):
        try:
            os.unlink(path)
        except OSError:
            pass


def _workload(doc):
    # (the plan's cooperative request: its ranks are told to resume once the GPU is theirs, held.resume_stopped)
    return {"cooperative": doc.get("cooperative"),
            "target": {"pids": doc.get("pids") or [], "cuda_pids": doc.get("cuda_pids") or [],
                       "identities": doc.get("identities") or {}, "states": doc.get("states") or {}},
            "runtime": {"backend": doc.get("runtime"), "container": doc.get("container"), "pod": doc.get("pod")}}


def _remove_partial_image(doc):
    """The image a dead checkpoint left without its manifest: removed (it restores nothing). Returns its path
    when removed."""
    image_dir = doc.get("image_dir")
    if not image_dir or not os.path.lexists(image_dir) or image.has_manifest(image_dir):
        return None
    try:
        image.discard(image_dir, {"created": doc.get("image_dir_created", True),
                                  "identity": doc.get("image_dir_identity")})
    except OSError:
        return None
    return image_dir


def give_back(journal_dir, record_id, backend, libcuda_path=None):
    """Give back the workload of record ``record_id`` when its holder died (see the module doc). Returns
    {"id", "changed", "phase" (what the record said), "given_back": the pids that run again, "msg"}; ``held``
    when a live checkpoint holds it. Raises GpuCkptError when the workload cannot be given back (the record
    stays, so that the next operation tries again)."""
    journal = Journal(journal_dir, record_id, "source")
    out = {"id": record_id, "changed": False, "held": False, "given_back": [], "phase": None}
    try:
        journal.acquire(wait=0, purpose="giving back the workload of checkpoint %s" % record_id)
    except JournalBusy:
        holder = journal.holder()
        return dict(out, held=True, holder=holder.get("pid"),
                    msg="checkpoint %s is still running (pid %s): nothing to give back" % (record_id, holder.get("pid")))
    try:
        doc = journal.read()
        phase = (doc or {}).get("phase")
        out["phase"] = phase
        if doc is None or phase in TERMINAL:
            forget(journal)
            return dict(out, msg="checkpoint %s had ended (%s)" % (record_id, phase or "nothing recorded"))
        if doc.get("after") not in (None, "running"):
            return dict(out, msg="checkpoint %s is a migration's (its workload left %s): recover.yml settles it"
                        % (record_id, doc.get("after")))
        manifest = _workload(doc)
        alive = alive_pids(manifest["target"]["identities"])
        traced = [(p, procfs.tracer(p)) for p in alive if procfs.tracer(p)]
        if traced:  # its holder died, and the dump it started did not (an OOM kill takes one process): let it end
            return dict(out, held=True, holder=traced[0][1],
                        msg="checkpoint %s: pid %d is still seized by pid %d (a dump its dead holder started): nothing "
                            "was touched; the next operation gives it back once that ends" % ((record_id,) + traced[0]))
        if alive:
            changed, pids = resume_stopped(manifest, backend, libcuda_path=libcuda_path)
            how = "given back (pids %s%s)" % (pids, "" if changed else ": they ran already")
        else:
            changed, pids = False, []
            how = ("none of its processes %s is left: nothing to give back, nothing restored"
                   % manifest["target"]["pids"]) if manifest["target"]["pids"] else "nothing was frozen yet"
        removed = _remove_partial_image(doc)
        if removed:
            how += "; its partial image %s was removed" % removed
        dead_holder = ((doc.get("history") or [{}])[-1]).get("pid")  # (who last moved the record on)
        journal.transition("resumed", given_back_at=now_iso(), given_back_pids=pids, given_back=how)
        forget(journal)
        return dict(out, changed=bool(changed or removed), given_back=pids,
                    msg="checkpoint %s (left at phase %s by a holder that is gone): %s" % (record_id, phase, how),
                    holder=dead_holder)
    except GpuCkptError as exc:
        exc.msg = "checkpoint %s (left at phase %s) could not be given back: %s" % (record_id, out["phase"], exc.msg)
        raise
    finally:
        journal.release()


def give_back_all(journal_dir, new_backend, prefix=MODULE_PREFIX, libcuda_path=None):
    """give_back() of every record in ``journal_dir`` whose id starts with ``prefix`` (each with a backend of its own,
    ``new_backend()``): what the next operation runs first. Returns the results of those that did something or
    failed; one that fails is reported as its ``error`` (the record stays)."""
    out = []
    for rid in records(journal_dir, prefix):
        try:
            res = give_back(journal_dir, rid, new_backend(), libcuda_path=libcuda_path)
            if res.get("changed") or res.get("given_back") or res.get("held"):
                out.append(res)
        except GpuCkptError as exc:
            out.append({"id": rid, "changed": False, "error": exc.msg})
    return out


def held_run(journal_dir, run, prefix=MODULE_PREFIX):
    """``run(record)`` (a checkpoint that leaves the workload running) under a new record in ``journal_dir``, kept
    while it holds the workload: should this process die between the freeze and the resume, the next give_back
    finds it. The record goes when ``run`` returns (the workload runs, or was rolled back); one whose rollback failed
    stays for the next give-back."""
    record = Journal(journal_dir, prefix + uuid.uuid4().hex, "source")
    try:
        return run(record)
    finally:
        finish_record(record)


def finish_record(record):
    """A checkpoint under ``record`` returned: the workload runs (leave_running), or the engine rolled it back. The
    record goes; one whose rollback failed stays for the next give-back."""
    with record.hold(wait=30, purpose="the end of checkpoint %s" % record.id):
        phase = record.phase
        if phase is not None and phase not in ("resumed", "rolled_back", "rollback_failed"):
            record.transition("resumed", ended="the checkpoint returned with the job running")
            phase = "resumed"
        if phase != "rollback_failed":
            forget(record)
