# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A migration's journal on one host: its phase, and the rules for moving it on.

<journal_dir>/<migration_id>.<role>.json, where role is source or target. Rules that hold whoever
writes, the controller's modules or a module whose controller died (an orphan):

- Every change is a transition from the phase read under the journal's lock (an flock on
  <id>.<role>.lock, released by the kernel when its holder dies), checked against the table below.
  An orphan that comes back after a recovery finds a phase it cannot move on from, and stops.
- A module that runs a long step (a checkpoint, a restore) holds the lock for the whole step and
  writes who it is into the lock file, so a waiter can say what it waits for; waits are bounded.
- A recovery that cannot take the source's lock (a checkpoint of a dead controller still runs there)
  first writes a fence (<id>.source.fence): the checkpoint stops at its next step and rolls itself
  back, instead of freezing and sending an image that nobody will restore.
- Processes are named by identity (pid, start time, boot id), never by a bare pid: a pid that was
  reused by another process after a crash or a reboot is not ours.
- Writes are atomic (fsutil.atomic_write) and keep a spare file for a full disk, so a rollback can
  still record what it did.

Plain Python with the standard library only: the receiving end of a transfer carries it too.
"""
from __future__ import annotations

import json
import os
import re
import time

from .errors import InvalidTarget, TransactionError
from .fsutil import Reserve, atomic_write, check_private_ancestors, make_dirs_private, read_json
from .procfs import boot_id, read_stat
from .wait import flock_within

DEFAULT_JOURNAL_DIR = "/var/lib/gpuckpt/journal"
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")

# Which phase may follow which. None is "no journal yet".
SOURCE_TRANSITIONS = {
    None: ("planned",),
    # the checkpoint itself: plan, freeze, dump, manifest; then the image goes to the target
    "planned": ("freezing", "rolled_back", "resumed"),
    "freezing": ("frozen", "rolled_back", "rollback_failed", "resumed"),
    "frozen": ("checkpointed", "rolled_back", "rollback_failed", "resumed"),
    # delivering: the manifest may have reached the target from here on, so the source is resumed
    # only once the target has been shown not to run the workload (see migration.rollback_source)
    "checkpointed": ("delivering", "committed", "resumed"),
    "delivering": ("delivering", "delivered", "committed", "resumed"),
    "delivered": ("delivering", "committed", "resumed"),
    "rollback_failed": ("resumed",),
}
TARGET_TRANSITIONS = {
    # cleaned from nothing: a settlement before the migration began here leaves a tombstone, so that
    # a start of a controller that died cannot begin it afterwards
    None: ("receiving", "cleaned"),
    "receiving": ("received", "cleaned"),
    # received: this migration's manifest landed (its nonce checked) under the lock
    "received": ("received", "restoring", "restore_failed", "cleaned"),  # restore_failed: its verification
    # restoring: past this point the workload may run here; only a restore that ended badly, or
    # whose module died (the lock is free while the phase says restoring), is cleaned
    "restoring": ("restored", "restore_failed", "cleaned"),
    "restore_failed": ("received", "restoring", "cleaned"),
    "restored": ("committed", "cleaned"),
}
TRANSITIONS = {"source": SOURCE_TRANSITIONS, "target": TARGET_TRANSITIONS}
TERMINAL = ("committed", "resumed", "rolled_back", "cleaned")


class JournalBusy(TransactionError):
    """The journal's lock is held by a step still running (possibly of a controller that died)."""


class Fenced(TransactionError):
    """A recovery fenced this migration: the step must stop and roll back what it did."""


def check_id(migration_id):
    if not migration_id or not ID_RE.match(str(migration_id)):
        raise InvalidTarget("migration_id %r must be 1-128 letters, digits, '.', '_' or '-'" % (migration_id,),
                            stage="preflight")
    return migration_id


def _starttime(pid):
    """(state letter, start time) of ``pid``, (None, None) when it does not exist."""
    st = read_stat(int(pid))
    return (st["state"], st["starttime"]) if st else (None, None)


def process_identity(pid):
    """{"pid", "starttime", "boot_id"} of a live process, or None."""
    state, start = _starttime(pid)
    if start is None:
        return None
    return {"pid": int(pid), "starttime": start, "boot_id": boot_id()}


def identities(pids):
    out = {}
    for p in pids or []:
        ident = process_identity(p)
        if ident:
            out[str(p)] = ident
    return out


def same_process(ident, boot=None):
    """The state letter of the process ``ident`` names when it still exists (the same pid, start time
    and boot), else None. A zombie counts as gone."""
    if not ident:
        return None
    if ident.get("boot_id") and ident["boot_id"] != (boot or boot_id()):
        return None
    state, start = _starttime(ident["pid"])
    if start is None or start != ident.get("starttime") or state in ("Z", "X"):
        return None
    return state


def alive_pids(idents):
    """The pids among ``idents`` ({pid: identity}) that are still those processes."""
    boot = boot_id()
    return sorted(int(p) for p, ident in (idents or {}).items() if same_process(ident, boot))


class Journal(object):
    def __init__(self, journal_dir, migration_id, role):
        self.dir = journal_dir or DEFAULT_JOURNAL_DIR
        self.id = check_id(migration_id)
        if role not in TRANSITIONS:
            raise InvalidTarget("journal role must be source or target, got %r" % (role,), stage="preflight")
        self.role = role
        base = os.path.join(self.dir, "%s.%s" % (self.id, role))
        self.path = base + ".json"
        self.lock_path = base + ".lock"
        self.fence_path = base + ".fence"
        self.reserve = Reserve(self.dir, ".reserve")
        self._lock_fd = None

    # -- reading ------------------------------------------------------------------------------------
    def read(self):
        return read_json(self.path)

    @property
    def phase(self):
        return (self.read() or {}).get("phase")

    # -- the lock -----------------------------------------------------------------------------------
    def _ensure_dir(self):
        make_dirs_private(self.dir)
        check_private_ancestors(os.path.join(self.dir, "x"))
        self.reserve.ensure()

    def holder(self):
        """Who holds (or last held) the lock: {"pid", "purpose", "since", ...} as its holder wrote it."""
        return read_json(self.lock_path) or {}

    def locked(self):
        return self._lock_fd is not None

    def acquire(self, wait=None, purpose=""):
        """Take the lock, waiting up to ``wait`` seconds (None: for ever). Raises JournalBusy naming
        the holder when it stays taken."""
        if self._lock_fd is not None:
            return self
        self._ensure_dir()
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            taken = flock_within(fd, wait, "the %s's journal lock of migration %s" % (self.role, self.id),
                                 on_timeout="return")
        except OSError:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            h = self.holder()
            raise JournalBusy(
                "migration %s: the %s's journal is held by %s (pid %s) since %s s ago; waited %s s for it"
                % (self.id, self.role, h.get("purpose") or "another step", h.get("pid", "?"),
                   int(time.time() - h.get("since", time.time())), wait),
                stage="journal", hint="that step is still running (a controller that died leaves it running); "
                                      "run the same command again once it has ended")
        self._lock_fd = fd
        try:  # who holds it, for a waiter's message; informational (a full disk must not stop us)
            info = json.dumps({"pid": os.getpid(), "purpose": purpose, "since": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
        except OSError:
            pass
        return self

    def release(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False

    def hold(self, wait=None, purpose=""):
        """``with journal.hold(wait, purpose):`` the lock for a block."""
        return _Held(self, wait, purpose)

    # -- fences -------------------------------------------------------------------------------------
    def fence(self, reason):
        """Ask whoever holds this journal to stop at its next step and roll back (see module doc)."""
        self._ensure_dir()
        if not os.path.exists(self.fence_path):
            atomic_write(self.fence_path, {"reason": reason, "time": time.time(), "pid": os.getpid()},
                         reserve=self.reserve)

    def fenced(self):
        return read_json(self.fence_path)

    def check_fence(self, step):
        f = self.fenced()
        if f:
            raise Fenced("migration %s was fenced by a recovery before %s (%s); rolling back"
                         % (self.id, step, f.get("reason")), stage=step)

    # -- writing ------------------------------------------------------------------------------------
    def _write(self, doc):
        atomic_write(self.path, doc, reserve=self.reserve)

    def transition(self, phase, **data):
        """Move to ``phase`` (under the lock), recording ``data``. Raises TransactionError when the table
        does not allow it from the phase read now. Returns the new document."""
        if self._lock_fd is None:
            raise RuntimeError("journal transition without its lock")
        doc = self.read()
        current = (doc or {}).get("phase")
        allowed = TRANSITIONS[self.role].get(current, ())
        if phase not in allowed:
            raise TransactionError("migration %s cannot go from %s to %s on the %s (%s)"
                                   % (self.id, current or "nothing", phase, self.role,
                                      "it is finished" if current in TERMINAL else "another step moved it on"),
                                   stage="journal", details={"phase": current})
        doc = doc or {"id": self.id, "role": self.role, "history": [], "boot_id": boot_id()}
        doc.update(data)
        doc["phase"] = phase
        doc["history"].append({"phase": phase, "time": time.time(), "pid": os.getpid()})
        self._write(doc)
        return doc

    def record(self, **data):
        """Add ``data`` without changing the phase (under the lock)."""
        if self._lock_fd is None:
            raise RuntimeError("journal record without its lock")
        doc = self.read()
        if doc is None:
            raise TransactionError("migration %s has no %s journal to record into" % (self.id, self.role),
                                   stage="journal")
        doc.update(data)
        self._write(doc)
        return doc


class _Held(object):
    def __init__(self, journal, wait, purpose):
        self.journal, self.wait, self.purpose = journal, wait, purpose
        self.took = False

    def __enter__(self):
        if not self.journal.locked():
            self.journal.acquire(self.wait, self.purpose)
            self.took = True
        return self.journal

    def __exit__(self, *exc):
        if self.took:
            self.journal.release()
        return False
