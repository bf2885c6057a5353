# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The images a replica store keeps of a job (the store's layout and its fencing: replica.py): their listing
(list_images), the commit that counts a pushed image (every checksum verified, its replica.json written, then
retention), their reading again (reverify), and the operations a node asks of a receiver (run_op).

An image counts once ``commit`` verified every checksum and wrote its replica.json; an image without one (a
push cut before its commit) is unverified. Retention keeps the newest ``keep`` verified images, never the
only verified one nor the one just committed, and removes failed pushes older than the newest verified image.

Standard library and core/ only: the receiver program (streams.receiver_program, bundled by core/bundle.py)
carries this file.
"""
from __future__ import annotations

import os
import stat
import time

from ..core.errors import GpuCkptError, ImageError, InvalidTarget
from ..core.fsutil import UnsafePath, atomic_write, identity, open_beneath, read_json, remove_tree
from ..core.image import MANIFEST, STATE_DIR, Image, image_bytes
from .replica import (JOB_RECORD, REPLICA_IMAGE_RE, _check_epoch, _check_node, _check_push_locked, _iso_utc, _job_locked,
                      _open_job_dir, _read_record, _time_of, check, check_image_id)

REPLICA_MARK = "replica.json"   # in the image's state dir
REPLICA_TRANSFER_MARK = "transfer.json"  # the receiver's mark of an image it is receiving (receiver.TRANSFER_MARK)
RETAIN_GRACE = 600  # seconds since an unverified image's directory last changed: younger, its commit may be coming


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
