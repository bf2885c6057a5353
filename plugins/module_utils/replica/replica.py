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
refused (EpochAhead), nothing written; none of the operations a node asks of the receiver (run_op) moves an epoch.

An image counts once ``commit`` verified every checksum and wrote its replica.json; an image without one (a
push cut before its commit) is unverified. Retention keeps the newest ``keep`` verified images, never the
only verified one nor the one just committed, and removes failed pushes older than the newest verified image.

Standard library and core/ only: the receiver program (transfer.receiver_program, bundled by core/bundle.py)
carries this file.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import stat
import time

from ..core.errors import GpuCkptError, ImageError, InvalidTarget
from ..core.fsutil import (UnsafePath, atomic_write, check_private_ancestors, identity, make_dirs_private, open_beneath,
                           open_dir, read_json, remove_tree)
from ..core.image import MANIFEST, STATE_DIR, Image, image_bytes
from ..core.wait import flock_within

JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
REPLICA_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
JOB_RECORD = "job.json"
JOB_LOCK = ".lock"
REPLICA_MARK = "replica.json"   # in the image's state dir
REPLICA_TRANSFER_MARK = "transfer.json"  # the receiver's mark of an image it is receiving (receiver.TRANSFER_MARK)
LOCK_WAIT = 300  # seconds: a commit verifies a whole image under the lock
RETAIN_GRACE = 600  # seconds since an unverified image's directory last changed: younger, its commit may be coming


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


# -- images ------------------------------------------------------------------------------------------
def _open_image(fd, root, job, image_id):
    path = os.path.join(os.path.abspath(root), job, check_image_id(image_id))
    try:
        img_fd = open_beneath(fd, image_id, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise ImageError("image %s of job %s is not on this replica" % (image_id, job), stage="verify")
    except (UnsafePath, OSError) as exc:
        raise ImageError("image %s of job %s: %s" % (image_id, job, exc), stage="verify")
    return Image(path, img_fd)


def _state_fd(img):
    try:
        os.mkdir(STATE_DIR, 0o700, dir_fd=img.fd)
    except FileExistsError:
        pass
    return open_beneath(img.fd, STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)


def _write_mark(img, doc):
    sfd = _state_fd(img)
    try:
        atomic_write(REPLICA_MARK, doc, dir_fd=sfd)
    finally:
        os.close(sfd)


def _read_mark(img, name=REPLICA_MARK):
    doc = read_json(os.path.join(STATE_DIR, name), dir_fd=img.fd)
    return doc if isinstance(doc, dict) else None


def _facts(manifest):
    target = manifest.get("target") or {}
    return {"host": manifest.get("host"), "runtime": manifest.get("runtime"),
            "target": {k: target.get(k) for k in ("pids", "cuda_pids", "gpus", "workload")},
            "gpu_stage": manifest.get("gpu_stage"),
            "image_bytes": (manifest.get("sizes") or {}).get("image_bytes", image_bytes(manifest))}


def _describe(fd, root, job, name):
    """One image of the job as list_images returns it, with "_ts" (its time, for sorting) and "_ours" (a receiver
    made it: it may be removed), or None when ``name`` is not an image directory."""
    try:
        img = _open_image(fd, root, job, name)
    except (ImageError, InvalidTarget):
        return None  # a symlink, a file, a name that is no image id: not ours, left alone
    with img:
        mark, pushed = _read_mark(img), _read_mark(img, REPLICA_TRANSFER_MARK) or {}
        complete, manifest = img.has_manifest(), {}
        if complete:
            try:
                manifest = img.manifest
            except ImageError:
                complete = False
        committed = mark or {}
        ts = _time_of(committed.get("checkpoint_at")) or _time_of(manifest.get("frozen_at")) or \
            _time_of(manifest.get("created")) or os.fstat(img.fd).st_mtime
        size = committed.get("bytes") or (image_bytes(manifest) if complete else _bytes_on_disk(img))
        origin = pushed.get("replica") or {}
        dated = complete or mark is not None  # else its time is the directory's, which only sorts it
        return {"id": name, "path": img.path, "checkpoint_at": _iso_utc(ts) if dated else None, "created": manifest.get("created"),
                "bytes": size, "verified": bool(complete and committed.get("verified") and not committed.get("corrupt")),
                "corrupt": committed.get("corrupt"), "committed": mark is not None,
                "epoch": committed.get("epoch", origin.get("epoch")), "node": committed.get("node", origin.get("node")),
                "progress": committed.get("progress"), "stall_s": committed.get("stall_s"), "complete": complete,
                "facts": _facts(manifest) if complete else None, "_ts": ts, "_mtime": os.fstat(img.fd).st_mtime,
                "_ours": pushed.get("image_id") == name or manifest.get("id") == name}


def _bytes_on_disk(img):
    try:
        return sum(st.st_size for st in img.files().values())
    except (OSError, GpuCkptError):
        return None


def _images(fd, root, job):
    """Every image directory of the job, newest first (with the private keys of _describe)."""
    out = []
    for name in os.listdir(fd):
        if REPLICA_IMAGE_RE.match(name) and name != JOB_RECORD:
            entry = _describe(fd, root, job, name)
            if entry is not None:
                out.append(entry)
    out.sort(key=lambda e: (e["_ts"], e["id"]), reverse=True)
    return out


def _public(entry):
    return {k: v for k, v in entry.items() if not k.startswith("_")}


def list_images(root, job):
    """{"record": the job's record or None, "images": [newest first]} (see _describe); writes nothing."""
    fd = _open_job_dir(root, job, False)
    if fd is None:
        return {"record": None, "images": []}
    try:
        return {"record": _read_record(fd, job), "images": [_public(e) for e in _images(fd, root, job)]}
    finally:
        os.close(fd)


def _verify_files(img, full):
    """Every file of the image against its manifest (no signature: that is checked at the restore, with the key).
    ``full``: read every byte again, not taking the receipts the receiver wrote as it received them (a receipt
    proves what was written then, not what the disk holds now)."""
    img.verify(None, allow_unverified_signature=True, use_receipts=not full)


def _retain(fd, root, job, keep, committed):
    """Retention after a commit: (kept ids, removed ids). An unverified image goes when it is older than the newest
    verified one and its directory has not changed for RETAIN_GRACE (a push delivered just now awaits its commit)."""
    images = _images(fd, root, job)
    verified = [e for e in images if e["verified"]]
    kept = verified[:keep] + [e for e in verified[keep:] if e["id"] == committed]
    if not kept:
        return [], []
    newest = max(e["_ts"] for e in kept)
    kept_ids = {e["id"] for e in kept}
    removed = []
    for e in images:
        if e["id"] in kept_ids or e["id"] == committed or not e["_ours"]:
            continue
        failed = e["_ts"] < newest and e["_mtime"] < time.time() - RETAIN_GRACE  # a push older than what is kept
        if e["verified"] or failed:
            st = os.lstat(e["path"])
            if stat.S_ISDIR(st.st_mode) and os.path.samestat(st, os.stat(e["id"], dir_fd=fd, follow_symlinks=False)):
                remove_tree(e["path"], identity(st))
                removed.append(e["id"])
    return [e["id"] for e in kept], removed


def commit(root, job, image_id, epoch, node, keep, meta=None):
    """Count a pushed image: the push checked again, every checksum verified, its replica.json written, then
    retention. Returns {"verified": True, "image_id", "kept", "removed"}. Raises StaleEpoch (fenced) or ImageError
    (the image does not verify: marked so, nothing removed)."""
    check_image_id(image_id)
    _check_epoch(epoch)
    _check_node(node)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidTarget("keep %r must be an integer of at least 1" % (keep,), stage="preflight")
    meta = meta or {}
    with _job_locked(root, job, True) as fd:
        _check_push_locked(fd, job, epoch, node)
        with _open_image(fd, root, job, image_id) as img:
            if not img.has_manifest():
                raise ImageError("image %s of job %s is incomplete (no %s): its push did not finish"
                                 % (image_id, job, MANIFEST), stage="verify")
            manifest = img.manifest
            if manifest.get("id") != image_id:
                raise ImageError("the manifest in %s is of image %s" % (img.path, manifest.get("id")), stage="verify")
            ts = _time_of(meta.get("checkpoint_at")) or _time_of(manifest.get("frozen_at")) or \
                _time_of(manifest.get("created")) or time.time()
            doc = {"verified": False, "verified_at": _iso_utc(time.time()), "epoch": epoch, "node": node,
                   "bytes": image_bytes(manifest), "checkpoint_at": _iso_utc(ts), "progress": meta.get("progress"),
                   "stall_s": meta.get("stall_s"), "corrupt": None}
            try:
                _verify_files(img, full=False)
            except ImageError as exc:
                _write_mark(img, dict(doc, corrupt=exc.msg))
                raise
            _write_mark(img, dict(doc, verified=True))
        kept, removed = _retain(fd, root, job, keep, image_id)
    return {"verified": True, "image_id": image_id, "kept": kept, "removed": removed}


def _reverify_locked(fd, root, job, image_id, write=True):
    """(verified, why not, whether replica.json was written: only when the verdict changed)."""
    try:
        img = _open_image(fd, root, job, image_id)
    except ImageError as exc:
        return False, exc.msg, False
    with img:
        mark = _read_mark(img)
        if mark is None:
            return False, "image %s was never committed (no %s): a push cut before its commit" % (image_id, REPLICA_MARK), False
        try:
            if not img.has_manifest():
                raise ImageError("image %s has no %s" % (image_id, MANIFEST), stage="verify")
            _verify_files(img, full=True)
            verdict = {"verified": True, "corrupt": None}
        except (ImageError, UnsafePath, OSError) as exc:
            verdict = {"verified": False, "corrupt": getattr(exc, "msg", str(exc))}
        changed = write and any(mark.get(k) != v for k, v in verdict.items())
        if changed:
            _write_mark(img, dict(mark, verified_at=_iso_utc(time.time()), **verdict))
        return verdict["verified"], verdict["corrupt"], changed


def reverify(root, job, image_id, write=True):
    """Read every byte of a committed image again: (True, None, changed), or (False, why, changed) with its
    replica.json marked ``verified: false, corrupt: why`` (not with ``write`` false; ``changed``: it was written).
    An image never committed is not verified."""
    check_image_id(image_id)
    with _job_locked(root, job, False) as fd:
        if fd is None:
            return False, "no image of job %s on this replica" % job, False
        return _reverify_locked(fd, root, job, image_id, write)


def verify_image(root, job, image_id):
    """True when the committed image verifies again; else False, its replica.json marked corrupt (see reverify)."""
    return reverify(root, job, image_id)[0]


# -- the receiver's non-data calls ----------------------------------------------------------------------
def run_op(config):
    """A replica operation the receiver was started for ({"replica_op": "check"|"commit"|"list", "root", "job",
    ...}); its reply (a dict)."""
    op, c = config.get("replica_op"), config
    if op == "check":
        return check(c["root"], c["job"], c["epoch"], c["node"], bool(c.get("create", False)))
    if op == "commit":
        return commit(c["root"], c["job"], c["image_id"], c["epoch"], c["node"], c["keep"], c.get("meta"))
    if op == "list":
        return list_images(c["root"], c["job"])
    raise InvalidTarget("unknown replica operation %r" % (op,), stage="preflight")
