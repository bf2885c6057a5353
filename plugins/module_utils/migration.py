# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Migration as a transaction: a journal on each host, and the commit/rollback steps that finish it.

The source stays stopped (not killed) until the target is restored and validated; then the source
is released. If anything fails, the target is cleaned and the source resumed. Every step is
idempotent and reads the journal first, so re-running migrate.yml or recover.yml with the same
migration id finishes or rolls back, and exactly one copy ends up running.

Journal: <journal_dir>/<migration_id>.<role>.json, rewritten atomically at each phase.
  source: freezing -> frozen -> checkpointed -> transferred -> committed | resumed
  target: receiving -> restoring -> restored -> committed | cleaned
When source and target share one pid namespace (one kernel seen as two hosts), the source cannot
stay stopped while the target reuses its pids: the source then exits after the dump and its own
image is the way back (hold 'image' instead of 'stopped').
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time

from . import discovery, engine, image
from .errors import InvalidTarget, TransactionError

DEFAULT_JOURNAL_DIR = "/var/lib/gpuckpt/journal"
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_id(migration_id):
    if not migration_id or not ID_RE.match(migration_id):
        raise InvalidTarget("migration_id %r must be 1-128 letters, digits, '.', '_' or '-'" % (migration_id,),
                            stage="preflight")
    return migration_id


class Journal(object):
    def __init__(self, journal_dir, migration_id, role):
        self.dir = journal_dir or DEFAULT_JOURNAL_DIR
        self.id = check_id(migration_id)
        self.role = role
        self.path = os.path.join(self.dir, "%s.%s.json" % (self.id, role))

    def read(self):
        try:
            with open(self.path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    # A restore that began before the image arrived (gpu_restore wait_for_image) holds the journal's
    # lock from its start to its end; a rollback of the target first asks it to stop waiting (the
    # cancel mark), then takes the lock, so it never cleans up under a restore that is bringing the
    # workload up, and never leaves one behind that would bring it up after the rollback.
    @property
    def cancel_path(self):
        return self.path[:-len(".json")] + ".cancel"

    def cancel(self):
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with open(self.cancel_path, "w") as fh:
            fh.write("%f\n" % time.time())

    def cancelled(self):
        return os.path.exists(self.cancel_path)

    def lock(self, wait=None):
        """Take the journal's lock (an open file with an exclusive flock; closing it releases the lock).
        ``wait``: seconds to wait for it (None: for ever). Returns the file, or None when it timed out."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fh = open(self.path[:-len(".json")] + ".lock", "a")
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fh
            except OSError:
                if deadline is not None and time.monotonic() > deadline:
                    fh.close()
                    return None
                time.sleep(0.05)

    @property
    def phase(self):
        return (self.read() or {}).get("phase")

    def write(self, phase, **data):
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        doc = self.read() or {"id": self.id, "role": self.role, "history": []}
        doc.update(data)
        doc["phase"] = phase
        doc["history"].append({"phase": phase, "time": time.time()})
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, self.path)
        return doc


def _alive_same(pids, identities=None):
    out = []
    for p in pids or []:
        st = discovery.read_stat(int(p))
        if st and st["state"] not in ("Z", "X"):
            ident = (identities or {}).get(str(p))
            if ident is None or ident.get("starttime") == st["starttime"]:
                out.append(int(p))
    return out


def status(journal, wait=0.0):
    """The journal, plus which of its pids run now. ``wait``: seconds to wait for a phase in flight
    (freezing, restoring) to settle, when a module is still at work after the controller died."""
    deadline = time.monotonic() + wait
    doc = journal.read()
    while doc and doc.get("phase") in ("freezing", "restoring") and time.monotonic() < deadline:
        time.sleep(0.5)
        doc = journal.read()
    if not doc:
        return {"exists": False, "phase": None, "role": journal.role, "id": journal.id}
    pids = doc.get("pids") or []
    running = _alive_same(pids, doc.get("identities") if journal.role == "source" else None)
    stopped = [p for p in running if (discovery.read_stat(p) or {}).get("state") in ("T", "t")]
    doc.update(exists=True, alive_pids=running, stopped_pids=stopped,
               running_pids=[p for p in running if p not in stopped])
    return doc


def _source_manifest(doc):
    image_dir = doc.get("image_dir")
    if image_dir and image.has_manifest(image_dir):
        return image.load_manifest(image_dir)
    return {"target": {"pids": doc.get("pids") or [], "cuda_pids": doc.get("cuda_pids") or [],
                       "identities": doc.get("identities") or {}}}


def commit_source(journal, backend=None, remove_image=False):
    """The target runs: release the stopped source (kill it), optionally remove the source image."""
    doc = journal.read()
    if doc is None:
        raise InvalidTarget("no journal for migration %s on this host (%s)" % (journal.id, journal.path),
                            stage="commit-source")
    if doc["phase"] == "committed":
        return False, "already committed"
    if doc["phase"] in ("resumed", "rolled_back"):
        raise TransactionError("migration %s was rolled back on the source (phase %s); it cannot be committed"
                               % (journal.id, doc["phase"]), stage="commit-source")
    changed, killed = False, []
    if doc.get("after") == "stopped":
        changed, killed = engine.release_stopped(_source_manifest(doc), backend)
    if remove_image and doc.get("image_dir") and os.path.isdir(doc["image_dir"]):
        shutil.rmtree(doc["image_dir"])
    journal.write("committed", released_pids=killed)
    return True, "source released (pids %s)" % killed


def rollback_source(journal, backend=None, libcuda_path=None):
    """Bring the source back to running: resume a stopped source, or restore it from its own image
    when it exited. Idempotent."""
    doc = journal.read()
    if doc is None:
        return False, "no journal: nothing was frozen on this host"
    if doc["phase"] == "committed":
        raise TransactionError("migration %s is committed: the workload runs on the target; rolling the source "
                               "back would start a second copy" % journal.id, stage="rollback-source")
    if doc["phase"] in ("resumed", "rolled_back"):
        return False, "already rolled back"
    manifest = _source_manifest(doc)
    target = manifest["target"]
    alive = _alive_same(target["pids"], target.get("identities"))
    if alive:
        changed, pids = engine.resume_stopped(manifest, backend, libcuda_path=libcuda_path)
        journal.write("resumed", resumed_pids=pids)
        return changed, "source resumed (pids %s)" % pids
    if doc.get("image_dir") and image.has_manifest(doc["image_dir"]):
        res = engine.restore(doc["image_dir"], backend=backend, libcuda_path=libcuda_path, force=True)
        journal.write("resumed", resumed_pids=res.get("pids"))
        return True, "source restored from its image %s (pids %s)" % (doc["image_dir"], res.get("pids"))
    raise TransactionError("the source's processes are gone and no complete image is in %s: cannot roll back"
                           % doc.get("image_dir"), stage="rollback-source")


def rollback_target(journal, image_dir=None, backend=None, restore_wait=1800.0):
    """Leave the target clean: kill what this migration restored there, remove its image copy.
    A restore still waiting for the image is told to stop first; one already restoring is waited for
    (up to ``restore_wait`` seconds), then what it brought up is killed."""
    from .runtimes.process import ProcessBackend
    backend = backend or ProcessBackend()
    if (journal.read() or {}).get("phase") != "committed":
        journal.cancel()
    held = journal.lock(wait=restore_wait)
    if held is None:
        raise TransactionError("a restore of migration %s is still running on the target after %s s; roll back "
                               "again once it has ended" % (journal.id, restore_wait), stage="rollback-target")
    try:
        return _rollback_target(journal, image_dir, backend)
    finally:
        held.close()


def _rollback_target(journal, image_dir, backend):
    doc = journal.read() or {}
    if doc.get("phase") == "committed":
        raise TransactionError("migration %s is committed on the target; refusing to kill the only copy" % journal.id,
                               stage="rollback-target")
    changed = False
    image_dir = image_dir or doc.get("image_dir")
    if image_dir and image.has_manifest(image_dir):
        backend.bind(image.load_manifest(image_dir))  # a container runtime needs the container's id
    alive = _alive_same(doc.get("pids") or [])
    if alive:
        backend.kill(alive)
        changed = True
    if image_dir and os.path.isdir(image_dir):
        shutil.rmtree(image_dir)
        changed = True
    if doc:
        if doc.get("phase") != "cleaned" or changed:
            journal.write("cleaned", killed_pids=alive)
    return changed, "target cleaned (killed %s, removed %s)" % (alive, image_dir)


def commit_target(journal, remove_image=False, image_dir=None):
    doc = journal.read()
    if doc is None or doc.get("phase") not in ("restored", "committed"):
        raise TransactionError("the target has not restored migration %s (phase %s)"
                               % (journal.id, (doc or {}).get("phase")), stage="commit-target")
    if doc["phase"] == "committed":
        return False, "already committed"
    alive = _alive_same(doc.get("pids"))
    if len(alive) != len(doc.get("pids") or []):
        raise TransactionError("restored pids %s are not all alive on the target" % doc.get("pids"),
                               stage="commit-target")
    image_dir = image_dir or doc.get("image_dir")
    if remove_image and image_dir and os.path.isdir(image_dir):
        shutil.rmtree(image_dir)
    journal.write("committed")
    return True, "target committed"
