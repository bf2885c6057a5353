# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Migration as a transaction, and how it ends: exactly one copy runs, and none runs twice.

The journals (journal.py) hold each host's phase. The rules that make a migration end well whatever
dies when (the controller, a module, the target host):

1. The target decides. A migration commits when, and only when, the target's journal says its
   restore ended well (``restored``) and those very processes still run; it rolls back otherwise.
   ``settle_target`` takes that decision under the target's lock, after any restore still running
   there has ended, and carries out the target's half at once: ``committed``, or ``cleaned`` (what a
   restore brought up is killed, what the transfer wrote is removed, and no receiver or restore of this
   migration can start there again). Every way out uses it: the end of migrate.yml, its rescue, a
   re-run with the same id, recover.yml.
2. The source follows. It is released (``commit_source``) only when the target says committed, and
   resumed (``rollback_source``) only when the target cannot run the workload: the target said
   cleaned, or the image never left the source (the source's journal never reached ``delivering``),
   or an operator declared the target lost. A recovery fences the source first, so a checkpoint
   of a dead controller still running there stops at its next step.
3. Nothing is removed that this migration did not create: directories are removed by the identity
   (device, inode) recorded when they were created, processes are killed by identity.

  source: planned -> freezing -> frozen -> checkpointed -> delivering -> delivered -> committed | resumed
          (a checkpoint that fails undoes itself: rolled_back)
  target: receiving -> received -> restoring -> restored -> committed | cleaned
          (restore_failed -> received again after a repair)
When source and target share one pid namespace (one kernel seen as two hosts), the source cannot
stay stopped while the target reuses its pids: it exits after the dump and its own image is the way
back (restored from it on rollback).
"""
from __future__ import annotations

import contextlib
import os
import uuid

from ..core import image
from ..core.errors import ImageError, InvalidTarget, TransactionError
from ..core.fsutil import UnsafePath, create_private_dir, remove_tree, same_dir
from ..core.journal import (DEFAULT_JOURNAL_DIR, Journal, alive_pids, check_id, identities, process_identity,  # noqa: F401
                            same_process)
from ..engine import in_memory
from ..engine.held import release_stopped, resume_stopped
from ..engine.restore import restore

RESTORE_WAIT = 1800.0  # how long a settlement waits for a restore that is still running


def status(journal):
    """The journal as read, plus which of its processes still run (by identity)."""
    doc = journal.read()
    if not doc:
        return {"exists": False, "phase": None, "role": journal.role, "id": journal.id,
                "fenced": bool(journal.fenced())}
    alive = alive_pids(doc.get("identities"))
    stopped = [p for p in alive if same_process((doc.get("identities") or {}).get(str(p))) in ("T", "t")]
    doc.update(exists=True, alive_pids=alive, stopped_pids=stopped, running_pids=[p for p in alive if p not in stopped],
               holder=journal.holder(), fenced=bool(journal.fenced()))
    return doc


# ---- the target ---------------------------------------------------------------------------------
def begin_target(journal, image_dir, wait=30.0, image_memory_bytes=None):
    """Before anything is frozen: create the directory this migration's image will arrive in (new,
    0700, below safe parents) and record it with a fresh nonce, the id the source's checkpoint must
    carry. A path that exists already (another job's image, a leftover, a symlink) is refused.
    ``image_memory_bytes``: the image's expected size, to keep it in memory here: a tmpfs of its own on
    that directory (engine/in_memory.target_plan), whose root's identity is the one recorded, so that
    every settlement's removal unmounts it. Returns (changed, journal document)."""
    image_dir = os.path.abspath(image_dir)
    with journal.hold(wait=wait, purpose="the start of migration %s" % journal.id):
        doc = journal.read()
        if doc:
            if doc.get("phase") == "receiving" and doc.get("image_dir") == image_dir and \
                    same_dir(image_dir, doc.get("image_dir_identity")):
                return False, doc
            raise TransactionError("migration %s was started on this host before (phase %s); settle it with "
                                   "recover.yml, or use a new migration id" % (journal.id, doc.get("phase")),
                                   stage="preflight")
        if os.path.lexists(image_dir):
            raise InvalidTarget("the target path %s exists already (%s); refusing to receive this migration's image "
                                "there: nothing was frozen" % (image_dir, _describe(image_dir)), stage="preflight",
                                hint="remove it if it is a leftover, or use another migration id or image root")
        memory = in_memory.target_plan(image_memory_bytes) if image_memory_bytes is not None else None
        try:
            ident = create_private_dir(image_dir)
        except (UnsafePath, FileExistsError, OSError) as exc:
            raise InvalidTarget("cannot create the target path %s: %s; nothing was frozen" % (image_dir, exc),
                                stage="preflight", hint="the image root must be owned by root and not writable by "
                                                        "other users")
        try:
            if memory is not None:
                made = {"identity": ident}
                in_memory.mount(image_dir, made, memory["size_bytes"], memory["tmpfs_huge"])  # (removes it on failure)
                ident = made["identity"]
            doc = journal.transition("receiving", image_dir=image_dir, image_dir_identity=ident,
                                     nonce=uuid.uuid4().hex, receivers={}, image_in_memory=memory)
        except Exception:
            if os.path.lexists(image_dir):
                remove_tree(image_dir, ident)
            raise
    return True, doc


def _describe(path):
    if os.path.islink(path):
        return "a symlink to %s" % os.readlink(path)
    if not os.path.isdir(path):
        return "a file"
    entries = sorted(os.listdir(path))
    if image.has_manifest(path):
        return "a complete image"
    return "a directory holding %s" % (", ".join(entries[:5]) or "nothing")


def settle_target(journal, backend=None, mode="settle", remove_image=True, wait=RESTORE_WAIT,
                  abandon_pod_restore=False):
    """Decide the migration on the target (rule 1 of the module doc) and carry out the target's half.
    Returns {"decision": "commit"|"rollback", "changed": bool, "phase": the target's phase, "msg"}.
    ``mode``: settle (either way), commit (refuse, changing nothing, when it cannot commit), or rollback
    (refuse, changing nothing, when the workload runs here). ``abandon_pod_restore``: the caller saw
    through the API server that the migration's target pod does not exist (see abandon_pod_restore)."""
    from ..runtimes.process import ProcessBackend
    backend = backend or ProcessBackend()
    if abandon_pod_restore:
        abandon_pod_restore_wait(journal, backend)
    with journal.hold(wait=wait, purpose="the settlement of migration %s" % journal.id):
        doc = journal.read()
        if not doc:
            # Nothing began here. The tombstone keeps a start of a dead controller from beginning later.
            journal.transition("cleaned", note="settled before anything began on this host")
            return _decision("rollback", True, "cleaned", "nothing of migration %s was on this host" % journal.id)
        phase = doc.get("phase")
        if phase == "committed":
            if mode == "rollback":
                raise TransactionError("migration %s is committed on this host; refusing to kill the only copy"
                                       % journal.id, stage="rollback-target")
            return _decision("commit", False, phase, "already committed: the workload runs here")
        if phase == "cleaned":
            if mode == "commit":
                raise TransactionError("migration %s was rolled back on this host; it cannot commit" % journal.id,
                                       stage="commit-target")
            return _decision("rollback", False, phase, "already rolled back on this host")
        alive = alive_pids(doc.get("identities")) if phase == "restored" else []
        if phase == "restored" and doc.get("pids") and len(alive) == len(doc["pids"]):
            if mode == "rollback":
                raise TransactionError("migration %s runs on this host (restored, pids %s): rolling it back would "
                                       "throw away what it did since; settle it instead (recover.yml)"
                                       % (journal.id, alive), stage="rollback-target")
            removed = remove_tree(doc.get("image_dir") or "", doc.get("image_dir_identity")) if remove_image else False
            journal.transition("committed", image_removed=removed)
            return _decision("commit", True, "committed", "the target runs the workload (pids %s)" % alive)
        if mode == "commit":
            raise TransactionError("the target has not restored migration %s, or its copy no longer runs (phase %s); "
                                   "nothing was changed" % (journal.id, phase), stage="commit-target")
        # Anything else: nothing runs here that may go on. A restore whose module died holds no lock
        # (the phase still says restoring): what it recorded is killed.
        killed = _clean(journal, doc, backend)
        return _decision("rollback", True, "cleaned", "target cleaned (%s)" % killed)


def abandon_pod_restore_wait(journal, backend):
    """A pod's restore here waits (restore_wait, 600 s by default) for the containers of a target pod that the
    controller creates; a controller that died before it created that pod leaves it waiting, with the journal's
    lock held, and the held source frozen behind it. When the caller has seen that the pod does not exist, the
    image's runtime (``backend``, the image's: Backend.abandon_restore_wait) tells that restore to give up. Only a
    restore still running, of the journal's own image directory, into a pod. Returns the names marked."""
    doc = journal.read() or {}
    image_dir = doc.get("image_dir") or ""
    ours = same_dir(image_dir, doc.get("image_dir_identity"))
    if doc.get("phase") != "restoring" or not doc.get("restore_pod") or not ours:
        return []
    return backend.abandon_restore_wait(image_dir)


def _decision(decision, changed, phase, msg):
    return {"decision": decision, "changed": changed, "phase": phase, "msg": msg}


def _clean(journal, doc, backend):
    receivers = alive_pids(doc.get("receivers"))
    for p in receivers:  # a transfer still writing here (a controller that died): stop it first
        try:
            os.kill(p, 9)
        except OSError:
            pass
    restored = alive_pids(doc.get("identities"))
    if doc.get("container") and doc.get("phase") in ("restoring", "restored"):
        backend = backend.with_container(doc["container"])
    if restored or (doc.get("container") and doc.get("phase") in ("restoring", "restored")):
        backend.kill_restored(doc.get("image_dir") or "", restored)
    image_dir = doc.get("image_dir") or ""
    removed = remove_tree(image_dir, doc.get("image_dir_identity"))
    journal.transition("cleaned", killed_pids=restored, killed_receivers=receivers, image_removed=removed)
    return "killed %s, removed %s" % (restored or "nothing", image_dir if removed else "nothing")


# ---- the source ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _source_image(doc):
    """``with _source_image(doc) as img``: the source's complete image of this migration, open, while
    its directory is still the one the checkpoint created; else None."""
    try:
        img = image.Image.open(doc["image_dir"]) if doc.get("image_dir") else None
    except ImageError:
        img = None
    try:
        yield img if img is not None and img.has_identity(doc.get("image_dir_identity")) and img.has_manifest() \
            else None
    finally:
        if img is not None:
            img.close()


def _source_manifest(doc, img):
    """What the source's checkpoint recorded of its workload: its image's manifest (``img``, from
    _source_image), else what its journal says."""
    if img is not None:
        return img.manifest
    return {"target": {"pids": doc.get("pids") or [], "cuda_pids": doc.get("cuda_pids") or [],
                       "identities": doc.get("identities") or {}, "states": doc.get("states") or {}},
            "runtime": {"backend": doc.get("runtime"), "container": doc.get("container")},
            "cooperative": doc.get("cooperative")}


def commit_source(journal, backend=None, target_phase=None, remove_image=False, wait=RESTORE_WAIT):
    """The target runs the workload (``target_phase`` must be what settle_target reported: committed):
    release the held source (kill it, by identity), optionally remove the source image."""
    with journal.hold(wait=wait, purpose="the commit of migration %s" % journal.id):
        doc = journal.read()
        if doc is None:
            raise InvalidTarget("no journal for migration %s on this host (%s)" % (journal.id, journal.path),
                                stage="commit-source")
        if doc["phase"] == "committed":
            return False, "already committed"
        if doc["phase"] in ("resumed", "rolled_back"):
            raise TransactionError("migration %s was rolled back on the source (phase %s); it cannot be committed"
                                   % (journal.id, doc["phase"]), stage="commit-source")
        if target_phase != "committed":
            raise TransactionError("migration %s: the target has not committed (it says %s); releasing the source "
                                   "could leave no copy running" % (journal.id, target_phase or "nothing"),
                                   stage="commit-source")
        killed = []
        with _source_image(doc) as img:
            if doc.get("after") == "stopped":
                _changed, killed = release_stopped(_source_manifest(doc, img), backend)
            elif backend is not None:
                backend.release_exited(_source_manifest(doc, img))
        removed = False
        if remove_image and doc.get("image_dir"):
            removed = remove_tree(doc["image_dir"], doc.get("image_dir_identity"))
        journal.transition("committed", released_pids=killed, image_removed=removed)
    return True, "source released (pids %s)" % killed


def rollback_source(journal, backend=None, target_phase=None, target_lost=False, libcuda_path=None,
                    wait=RESTORE_WAIT, keep_image=False):
    """Bring the source back to running (rule 2 of the module doc): resume a held source, or restore
    it from its own image when it exited. Idempotent. ``target_phase``: what settle_target reported
    (cleaned proves the target cannot run it); ``target_lost``: an operator's word that the target is
    gone for good. Once the source runs again, its image of this migration is no way back any more
    (the next try checkpoints anew): it is removed, and the message and the journal name it
    (``image_removed``); ``keep_image`` keeps it, named too (``image_kept``)."""
    journal.fence("a rollback of migration %s" % journal.id)
    with journal.hold(wait=wait, purpose="the rollback of migration %s" % journal.id):
        doc = journal.read()
        if doc is None:
            return False, "nothing was frozen on this host"
        phase = doc["phase"]
        if phase == "committed":
            raise TransactionError("migration %s is committed: the workload runs on the target; rolling the source "
                                   "back would start a second copy" % journal.id, stage="rollback-source")
        if phase in ("resumed", "rolled_back"):
            return False, "already rolled back"
        if phase in ("delivering", "delivered") and target_phase != "cleaned" and not target_lost:
            raise TransactionError(
                "migration %s: the image may have reached the target (the source was %s it), and the target has not "
                "been shown to be clean (it said %s): resuming the source could start a second copy, so it stays "
                "held" % (journal.id, phase, target_phase or "nothing, or could not be reached"),
                stage="rollback-source",
                hint="run recover.yml once the target answers; if the target is gone for good, run it with "
                     "-e gpuckpt_target_lost=true")
        with _source_image(doc) as img:
            changed, pids, how = _bring_source_back(doc, img, backend, libcuda_path)
        # Only now, the source confirmed running (a resume or restore that fails raised above, the image kept).
        image_note, how = _settle_source_image(doc, keep_image, how)
        try:
            journal.transition("resumed", resumed_pids=pids, resumed_identities=identities(pids or []), **image_note)
        except (OSError, TransactionError) as exc:  # it runs; a full disk must not undo that
            how += " (its journal could not be written: %s)" % exc
    return changed, how


def _settle_source_image(doc, keep_image, how):
    """The source's image of a migration rolled back, once the source runs again: removed (the whole
    directory when the checkpoint created it, else what it wrote there), or kept when asked. Returns
    (what the journal records of it, ``how`` completed with it)."""
    image_dir = doc.get("image_dir")
    if not image_dir or not os.path.lexists(image_dir):
        return {}, how
    if keep_image:
        return {"image_kept": image_dir}, how + "; its image is kept in %s (keep_image_on_rollback)" % image_dir
    if not same_dir(image_dir, doc.get("image_dir_identity")):
        return {"image_kept": image_dir}, how + ("; %s was left alone: it is not the directory this migration's "
                                                 "checkpoint wrote" % image_dir)
    try:
        image.discard(image_dir, {"created": doc.get("image_dir_created", True),
                                  "identity": doc.get("image_dir_identity")})
    except OSError as exc:  # it runs; a file that cannot be removed must not fail the rollback
        return {"image_kept": image_dir}, how + "; its image in %s could not be removed: %s" % (image_dir, exc)
    return {"image_removed": image_dir}, how + "; its image %s was removed" % image_dir


def _bring_source_back(doc, img, backend, libcuda_path):
    """Resume the held source, or restore it from its own image ``img`` (see _source_image) when it
    exited. Returns (changed, pids that run, what was done)."""
    manifest = _source_manifest(doc, img)
    if alive_pids(manifest["target"].get("identities")):
        changed, pids = resume_stopped(manifest, backend, libcuda_path=libcuda_path)
        return changed, pids, "source resumed (pids %s)" % pids
    if img is None:
        raise TransactionError("the source's processes are gone and no complete image of this migration is in %s: "
                               "cannot roll back" % doc.get("image_dir"), stage="rollback-source")
    # The source's own image, written on this host by this migration and never sent anywhere: it is trusted as the
    # host is. A signed one is restored without its key here, so that the way back never depends on a key that
    # only the operator holds (a rollback that refused would leave the workload stopped).
    pids = restore(img, backend=backend, libcuda_path=libcuda_path, force=True, allow_unverified_signature=True).get("pids")
    return True, pids, "source restored from its image %s (pids %s)" % (doc["image_dir"], pids)


__all__ = ["Journal", "begin_target", "settle_target", "commit_source", "rollback_source", "status", "check_id",
           "DEFAULT_JOURNAL_DIR", "process_identity"]
