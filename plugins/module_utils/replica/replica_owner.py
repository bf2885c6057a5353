# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who owns a protected job, as a replica records it, moved only by the controller's calls (gpu_replica): a
failover (the epoch raised by one, the owner changed), the operator's re-protect, and the target's word that it
runs the job (adopt). None of this is in the receiver program (replica_images.run_op): no operation a node sends
to a replica moves an epoch or an owner. The record's layout and the rules of fencing: replica/replica.py."""
from __future__ import annotations

import fcntl
import os
import time

from ..core.errors import ImageError, InvalidTarget
from ..core.fsutil import UnsafePath, atomic_write, check_private_ancestors, make_dirs_private, open_beneath, open_dir, read_json
from .replica import (JOB_RECORD, FailoverRefused, _check_epoch, _check_node, _history, _iso_utc, _job_locked, _read_record,
                      check_image_id, check_job)
from .replica_images import _images, _reverify_locked


# -- failover ----------------------------------------------------------------------------------------
def _failover_refusal(record, job, lost_node, target):
    """Why a failover of ``job`` from ``lost_node`` to ``target`` would leave two copies, or None."""
    if record is None:
        return "there is no record of job %s on this replica: nothing was protected here" % job
    if record["owner"] != lost_node:
        if any(h.get("event") == "failover" and h.get("from") == lost_node for h in record.get("history") or []):
            return "job %s runs on %s since epoch %s: it was already failed over" % (job, record["owner"], record["epoch"])
        return "lost_node %s is not the job's owner (%s at epoch %s)" % (lost_node, record["owner"], record["epoch"])
    if target == record["owner"]:
        return "target %s is the job's owner (the lost node); choose another target" % target
    return None


def _failover_locked(fd, job, lost_node, target, image_id, reason, write=True):
    record = _read_record(fd, job)
    refusal = _failover_refusal(record, job, lost_node, target)
    if refusal:
        raise FailoverRefused(refusal, stage="preflight", details={"record": record})
    record["epoch"] += 1
    record["owner"] = target
    record["history"] = list(record.get("history") or []) + [
        _history("failover", record["epoch"], target, lost_node, image_id, reason)]
    if write:
        atomic_write(JOB_RECORD, record, dir_fd=fd)
    return record


def failover(root, job, lost_node, target, image_id, reason=None, write=True):
    """Hand the job to ``target``: the epoch raised by one, the owner changed, the history appended (the record as
    it would be, unwritten, without ``write``). Refuses (FailoverRefused) when ``lost_node`` is not the owner
    (already failed over) or ``target`` is."""
    _check_node(lost_node, "lost_node")
    _check_node(target, "target")
    with _job_locked(root, job, False) as fd:
        return _failover_locked(fd, job, lost_node, target, image_id, reason, write)


def failover_verified(root, job, lost_node, target, candidates=None, reason=None, write=True):
    """gpu_replica's failover: refused as failover() refuses, before anything is read; then each candidate (image
    ids in order of preference; default: the verified images, newest first) read again, the corrupt ones marked,
    and the job handed over with the first that verifies; all of it under the job's lock. ``write`` false (check
    mode) marks nothing and raises no epoch. Returns {"record", "image_id", "image_path", "epoch", "skipped"}."""
    _check_node(lost_node, "lost_node")
    _check_node(target, "target")
    with _job_locked(root, job, False) as fd:
        refusal = _failover_refusal(_read_record(fd, job), job, lost_node, target)
        if refusal:
            raise FailoverRefused(refusal, stage="preflight")
        if candidates is None:
            candidates = [e["id"] for e in _images(fd, root, job) if e["verified"]]
        skipped = []
        for image_id in candidates:
            ok, why, unused = _reverify_locked(fd, root, job, check_image_id(image_id), write)
            if not ok:
                skipped.append({"id": image_id, "reason": why})
                continue
            record = _failover_locked(fd, job, lost_node, target, image_id, reason) if write else None
            return {"record": record, "image_id": image_id, "epoch": record["epoch"] if record else None,
                    "image_path": os.path.join(os.path.abspath(root), job, image_id), "skipped": skipped}
        raise ImageError("no image of job %s on this replica verifies (%d tried); the epoch was not raised"
                         % (job, len(candidates)), stage="verify", details={"skipped": skipped})


# -- the operator's re-protect ----------------------------------------------------------------------------
def reprotect(root, job, epoch, node, reason=None, write=True):
    """The operator protected ``job`` on ``node`` again at ``epoch`` (the role gpuckpt.fleet.protect, through
    gpu_replica state=reprotect, with the highest epoch the job's replicas record): the record is created when there
    is none, or its epoch raised to ``epoch`` when ``node`` owns it (a replica that missed a failover's epoch while
    the job came back to its node). Never through a push or a commit, and no operation a node sends to the receiver
    (run_op) does it. Refuses (FailoverRefused) a record of another owner (only a failover moves the owner) and one
    at a higher epoch than ``epoch``. ``write`` false (check mode): what it would record. Returns {"record",
    "changed"}."""
    _check_epoch(epoch)
    _check_node(node)
    why = reason or "protected again by the operator"
    with _job_locked(root, job, write) as fd:
        record = _read_record(fd, job)
        if record is None:
            record = {"job": check_job(job), "epoch": epoch, "owner": node,
                      "history": [_history("adopted", epoch, node, reason=why)]}
        elif record["owner"] != node:
            raise FailoverRefused("job %s belongs to %s at epoch %s on this replica, not to %s: a failover moves a job "
                                  "to another owner, a re-protect does not" % (job, record["owner"], record["epoch"],
                                                                               node),
                                  stage="preflight", details={"record": record})
        elif record["epoch"] > epoch:
            raise FailoverRefused("job %s is at epoch %s on this replica, higher than %s: protect it again with its "
                                  "current epoch" % (job, record["epoch"], epoch), stage="preflight",
                                  details={"record": record})
        elif record["epoch"] == epoch:
            return {"record": record, "changed": False}
        else:
            record = dict(record, epoch=epoch, history=list(record.get("history") or []) + [
                _history("reprotected", epoch, node, node, reason="%s (epoch %s before)" % (why, record["epoch"]))])
        if write:
            atomic_write(JOB_RECORD, record, dir_fd=fd)
        return {"record": record, "changed": True}


# -- the target's word that it owns the job ---------------------------------------------------------
def adopt(journal_dir, job, epoch, owner, lost_node=None, image_id=None, write=True):
    """Record in ``journal_dir`` (protect-<job>.json) that this host, ``owner``, runs ``job`` from ``epoch`` on.
    Refuses (FailoverRefused) when the file already names an epoch at least as high. Returns the document."""
    check_job(job)
    _check_epoch(epoch)
    _check_node(owner, "owner")
    name = "protect-%s.json" % job
    doc = {"job": job, "epoch": epoch, "owner": owner, "from": lost_node, "image_id": image_id, "at": _iso_utc(time.time())}
    if write:
        try:
            make_dirs_private(journal_dir)
            check_private_ancestors(os.path.join(journal_dir, name))
        except UnsafePath as exc:
            raise InvalidTarget("journal_dir %s: %s" % (journal_dir, exc), stage="preflight")
    elif not os.path.isdir(journal_dir):
        return doc  # check mode, and nothing recorded here yet
    fd = open_dir(journal_dir)
    try:
        lock_fd = open_beneath(fd, "protect-%s.lock" % job, os.O_RDWR | os.O_CREAT) if write else None
        try:
            if lock_fd is not None:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            old = read_json(name, dir_fd=fd)
            if isinstance(old, dict) and isinstance(old.get("epoch"), int) and old["epoch"] >= epoch:
                raise FailoverRefused("this host already records job %s at epoch %s (>= %s); refusing to adopt it again"
                                      % (job, old["epoch"], epoch), stage="preflight", details={"adopted": old})
            if write:
                atomic_write(name, doc, dir_fd=fd)
            return doc
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
    finally:
        os.close(fd)


# -- a migration's handover -----------------------------------------------------------------------------
def _made_owner(record):
    """The history entry that made the record's owner the owner (a re-protect keeps the owner), or None."""
    for entry in reversed(record.get("history") or []):
        if entry.get("event") != "reprotected":
            return entry if entry.get("owner") == record["owner"] else None
    return None


def handover(root, job, from_node, to_node, reason=None, write=True):
    """A migration (migrate.yml, drain.yml) moved ``job`` from ``from_node`` to ``to_node``, both up: the record
    names ``to_node`` as the owner, at the epoch raised by one, so that ``from_node``'s pushes are refused from
    then on and its fence check stops any copy left there. Idempotent: a record that already names ``to_node``
    because a move from ``from_node`` made it the owner is left as it is (a re-run). Refuses (FailoverRefused) a
    record of a third owner, and one that names ``to_node`` since anything else (a failover from ``from_node``: the
    workload moved was a stale copy, or not this job's at all; never passed over in silence). A replica that has
    no record of the job (it never got a push) gets none. Returns {"record" (None without one), "changed"}."""
    _check_node(from_node)
    _check_node(to_node, "target")
    if from_node == to_node:
        raise InvalidTarget("a handover needs two nodes, got %s twice" % from_node, stage="preflight")
    with _job_locked(root, job, False) as fd:
        record = _read_record(fd, job)
        if record is None:
            return {"record": record, "changed": False}
        if record["owner"] == to_node:
            made = _made_owner(record)
            if made and made.get("event") == "moved" and made.get("from") == from_node:
                return {"record": record, "changed": False}
            raise FailoverRefused("job %s already belongs to %s at epoch %s on this replica, since %s, not since a move "
                                  "from %s: the workload moved from %s is not the job's copy (a stale one, or another "
                                  "job's); nothing handed over" % (
                                      job, to_node, record["epoch"],
                                      "its %s (from %s) at epoch %s" % (made.get("event"), made.get("from"),
                                                                        made.get("epoch")) if made else "its first record",
                                      from_node, from_node),
                                  stage="preflight", details={"record": record})
        if record["owner"] != from_node:
            raise FailoverRefused("job %s belongs to %s at epoch %s on this replica, not to %s: it was not moved from "
                                  "there" % (job, record["owner"], record["epoch"], from_node), stage="preflight",
                                  details={"record": record})
        epoch = record["epoch"] + 1
        record = dict(record, epoch=epoch, owner=to_node, history=list(record.get("history") or []) + [
            _history("moved", epoch, to_node, from_node, reason=reason or "moved by a migration")])
        if write:
            atomic_write(JOB_RECORD, record, dir_fd=fd)
        return {"record": record, "changed": True}
