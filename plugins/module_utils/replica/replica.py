# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The replica store: a protected job's images kept on another host than the job's node, and who owns the job.

  <root>/<job>/                 0700, one per job, never a symlink
  <root>/<job>/job.json         the replica's journal of the job: its epoch, its owner (a node's inventory name)
                                and its history (adopted, failover, reprotected)
  <root>/<job>/.lock            flock: one writer of the job at a time (a commit, a failover, a push's manifest)
  <root>/<job>/<image_id>/      an image as the receiver writes it (manifest.json last)
  <root>/<job>/<image_id>/.gpuckpt/replica.json   what the replica knows of the image: verified, epoch, node,
                                bytes, checkpoint_at, progress, stall_s, corrupt (why a later verification failed)

Fencing: each failover raises the job's epoch and names the new owner. A push carries the epoch and the
node it comes from (check_push): one of an older epoch, or of the current epoch from a node that is not the
owner, is refused before the receiver writes a byte and again, under the job's lock, before it writes the
manifest. A node cut off from the controller but not from its replica may still run its copy: its pushes
are refused, and the node's runner stops it at its next fence check (check, which writes nothing).

Epochs and owners are the replica's alone: the first push of a job to a replica records its node and epoch, and
from then on only a failover (failover, failover_verified) or the operator's re-protect (reprotect: gpu_replica, as
the protect role runs it) moves them. A push or a commit of the owner at a higher epoch than the record's is
refused (EpochAhead), nothing written; none of the operations a node asks of the receiver (replica_images.run_op) moves an epoch.

Standard library and core/ only: the receiver program (streams.receiver_program, bundled by core/bundle.py)
carries this file. The images of a job (listing, commit, retention, reverification): replica_images.py.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import stat
import time

from ..core.errors import GpuCkptError, InvalidTarget
from ..core.fsutil import (UnsafePath, atomic_write, check_private_ancestors, identity, make_dirs_private, open_beneath,
                           open_dir, read_json)
from ..core.wait import flock_within

JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
REPLICA_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
JOB_RECORD = "job.json"
JOB_LOCK = ".lock"
LOCK_WAIT = 300  # seconds: a commit verifies a whole image under the lock


class StaleEpoch(GpuCkptError):
    """A push or commit of a fenced copy: the job was failed over (a newer epoch), or another node owns it."""

    fenced = True


class FailoverRefused(GpuCkptError):
    """A failover that would leave two copies: the job was already failed over, or the target owns it."""


class EpochAhead(GpuCkptError):
    """A push, commit or call of the job's owner at a higher epoch than the replica's record: refused, nothing
    written. Epochs are the replica's: only a failover or the operator's re-protect (reprotect) moves one."""

    fenced = False


def check_job(name):
    if not isinstance(name, str) or not JOB_RE.match(name):
        raise InvalidTarget("job name %r must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                            "digit" % (name,), stage="preflight")
    return name


def check_image_id(image_id):
    """An image id is one path component of the job's directory: no '/', never '.' or '..', not the record."""
    if not isinstance(image_id, str) or not REPLICA_IMAGE_RE.match(image_id) or image_id == JOB_RECORD:
        raise InvalidTarget("image id %r must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
                            "digit" % (image_id,), stage="preflight")
    return image_id


def _check_epoch(epoch):
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise InvalidTarget("epoch %r must be an integer of at least 1" % (epoch,), stage="preflight")
    return epoch


def _check_node(node, what="node"):
    if not isinstance(node, str) or not node or len(node) > 255 or any(ord(c) < 32 for c in node):
        raise InvalidTarget("%s %r must be a host's inventory name" % (what, node), stage="preflight")
    return node


def _iso_utc(ts):
    return None if ts is None else datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat()


def _time_of(value):
    """Seconds since the epoch of a time as a manifest or meta gives it (a number, or ISO 8601), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


# -- the job's directory, record and lock ----------------------------------------------------------------
def _open_job_dir(root, job, create):
    """An fd on <root>/<job> (created 0700 below private parents with ``create``), or None when it is not there.
    Refuses a symlink, a file, or a directory that is not ours or that others can write."""
    path = os.path.join(os.path.abspath(root), check_job(job))
    try:
        if create:
            make_dirs_private(os.path.abspath(root))
            check_private_ancestors(path)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        fd = open_dir(path)
    except FileNotFoundError:
        return None
    except UnsafePath as exc:
        raise InvalidTarget("replica store %s: %s" % (path, exc), stage="preflight",
                            hint="the job's directory must be a directory of root's, not a symlink")
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise InvalidTarget("replica store %s belongs to uid %d or others can write it (mode %o); refusing it"
                            % (path, st.st_uid, stat.S_IMODE(st.st_mode)), stage="preflight")
    return fd


@contextlib.contextmanager
def _job_locked(root, job, create, wait=LOCK_WAIT):
    """The job's directory fd (None when absent and not ``create``), held under its lock."""
    fd = _open_job_dir(root, job, create)
    if fd is None:
        yield None
        return
    lock_fd = None
    try:
        lock_fd = open_beneath(fd, JOB_LOCK, os.O_RDWR | os.O_CREAT)
        flock_within(lock_fd, wait, "the lock of job %s in the replica store %s" % (job, root), stage="replica",
                     max_interval=0.5)
        yield fd
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases the flock
        os.close(fd)


def _read_record(fd, job):
    if fd is None:
        return None
    try:
        os.stat(JOB_RECORD, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    doc = read_json(JOB_RECORD, dir_fd=fd)
    if not isinstance(doc, dict) or not isinstance(doc.get("epoch"), int) or not doc.get("owner"):
        raise GpuCkptError("the replica's record of job %s (%s) is unreadable; refusing to guess its epoch" % (job, JOB_RECORD),
                           stage="replica", hint="repair or remove %s by hand, knowing which node runs the job" % JOB_RECORD)
    return doc


def _history(event, epoch, owner, previous=None, image_id=None, reason=None):
    return {"event": event, "epoch": epoch, "owner": owner, "from": previous, "at": _iso_utc(time.time()),
            "image_id": image_id, "reason": reason}


def _fence_message(record, job, epoch, node):
    moves = [h for h in record.get("history") or [] if h.get("event") == "failover"]
    if moves:
        head = "job %s was failed over to %s at epoch %s" % (job, moves[-1].get("owner"), moves[-1].get("epoch"))
        if moves[-1].get("owner") != record["owner"]:
            head += " (now %s at epoch %s)" % (record["owner"], record["epoch"])
    else:
        head = "job %s belongs to %s at epoch %s on this replica" % (job, record["owner"], record["epoch"])
    return "%s; the copy on %s (epoch %s) is fenced" % (head, node, epoch)


def _refuse_fenced(record, job, epoch, node):
    """Raise StaleEpoch when ``node`` at ``epoch`` is not the job's copy that the record names."""
    if epoch < record["epoch"] or node != record["owner"]:
        raise StaleEpoch(_fence_message(record, job, epoch, node), stage="replica",
                         details={"fenced": True, "epoch": record["epoch"], "owner": record["owner"]},
                         hint="the job runs elsewhere now: stop this copy (the node's next fence check does)")


def _refuse_ahead(record, job, epoch, node):
    """Raise EpochAhead when ``node`` (the owner) names a higher epoch than the record's: a push never moves it."""
    if epoch > record["epoch"]:
        raise EpochAhead(
            "job %s: %s at epoch %s is ahead of this replica's record (%s at epoch %s); refused, nothing written: a "
            "job's epoch moves only by a failover or by the operator's re-protect, never by a push or a commit"
            % (job, node, epoch, record["owner"], record["epoch"]), stage="replica",
            details={"fenced": False, "ahead": True, "epoch": record["epoch"], "owner": record["owner"]},
            hint="protect the job again with the role gpuckpt.fleet.protect (it records the job's epoch on each of its "
                 "replicas: gpuckpt.fleet.gpu_replica state=reprotect), or correct the node's config of the job")


def _check_push_locked(fd, job, epoch, node):
    record = _read_record(fd, job)
    if record is None:
        record = {"job": job, "epoch": epoch, "owner": node,
                  "history": [_history("adopted", epoch, node, reason="the first push of the job to this replica")]}
        atomic_write(JOB_RECORD, record, dir_fd=fd)
        return record
    _refuse_fenced(record, job, epoch, node)
    _refuse_ahead(record, job, epoch, node)
    return record


def check_push(root, job, epoch, node, create=True):
    """The job's record, once a push from ``node`` at ``epoch`` may go on (created, with ``node`` as the owner,
    when there is none and ``create``; None when there is none and not ``create``). Raises StaleEpoch for a fenced
    copy: an older epoch, or the current one from another node than the owner; EpochAhead for the owner at a higher
    epoch than the record's (never adopted: see reprotect)."""
    _check_epoch(epoch)
    _check_node(node)
    if create:
        with _job_locked(root, job, True) as fd:
            return _check_push_locked(fd, job, epoch, node)
    # Read only: no lock awaited (a commit may hold it for minutes); the record is replaced atomically.
    fd = _open_job_dir(root, job, False)
    try:
        record = _read_record(fd, job)
    finally:
        if fd is not None:
            os.close(fd)
    if record is not None:
        _refuse_fenced(record, job, epoch, node)
        _refuse_ahead(record, job, epoch, node)
    return record


def check(root, job, epoch, node, create=False):
    """check_push as the node's fence check asks it: {"epoch", "owner", "fenced", "reason"}, never raising
    StaleEpoch; without ``create``, nothing is written and no lock awaited (a commit may hold it for minutes).
    The owner at a higher epoch than the record's is not fenced (the record names it): "ahead" and the reason say
    that its pushes are refused until the operator protects the job again."""
    try:
        record = check_push(root, job, epoch, node, create)
    except StaleEpoch as exc:
        return {"epoch": exc.details["epoch"], "owner": exc.details["owner"], "fenced": True, "reason": exc.msg}
    except EpochAhead as exc:
        return {"epoch": exc.details["epoch"], "owner": exc.details["owner"], "fenced": False, "ahead": True,
                "reason": exc.msg}
    if record is None:
        return {"epoch": None, "owner": None, "fenced": False, "reason": "no record of job %s on this replica" % job}
    return {"epoch": record["epoch"], "owner": record["owner"], "fenced": False, "reason": None}


@contextlib.contextmanager
def push_guard(root, job, epoch, node):
    """Held while the receiver writes a pushed image's manifest: the push is checked again, and no failover
    can come between that check and the manifest (it takes the same lock)."""
    _check_epoch(epoch)
    _check_node(node)
    with _job_locked(root, job, True) as fd:
        _check_push_locked(fd, job, epoch, node)
        yield


def check_image_parent(root, job, dir_fd):
    """Refuse an opened image directory that is not right below the job's directory (the receiver's dest)."""
    fd = _open_job_dir(root, job, False)
    try:
        if fd is None or identity(os.stat("..", dir_fd=dir_fd)) != identity(os.fstat(fd)):
            raise InvalidTarget("the image directory is not below the replica store's directory of job %s" % job,
                                stage="preflight")
    finally:
        if fd is not None:
            os.close(fd)
