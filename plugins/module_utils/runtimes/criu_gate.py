# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A gate in CRIU's restore: the restored tree waits at CRIU's post-restore action (its memory in
place, not one instruction of it run) until the engine gives its verdict on the image's page files.
"ok" lets CRIU resume the tree; anything else, or no word at all (the engine died, and the kernel let
go of its lock on the gate), makes the action fail, and CRIU then kills the tree and fails the restore.

So the pages' checksums can run beside CRIU's restore instead of before it (5.2 s of a 62 GB restore's
20.6 s on an H100, docs/benchmarks), and still no restored process ever runs from pages that did not
check out. The rest of the image (CRIU's metadata, which steers what CRIU does as root) is checked
before CRIU starts.

CRIU runs an action script by exec, for every action: it must be an executable file on a filesystem
that allows exec. The gate writes one into a private directory (0700) on the first such filesystem
of a few, runs it once itself, and is None where none works; the engine then checks all first.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile

SCRIPT = """#!/bin/sh
# gpuckpt.fleet: CRIU's action script for one restore (runtimes/criu_gate.py). At post-restore the tree
# is restored and has not run: wait for the engine's lock on the gate to go (given up with the verdict
# written, or by the kernel when the engine died), then pass only on the verdict "ok". Anything else,
# or none, fails, and CRIU kills the tree. Every other action passes.
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
exec 9< '%(dir)s/lock' || exit 1
'%(flock)s' -s 9 || exit 1
IFS= read -r verdict < '%(dir)s/verdict' || exit 1
[ "$verdict" = ok ]
"""
PLACES = (tempfile.gettempdir(), "/run", "/var/tmp", "/dev/shm")
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+\Z")  # quoted into the script


class RestoreGate(object):
    """One restore's gate: ``criu_args`` go to CRIU's restore command; ``decide(ok)`` gives the verdict
    (once); ``close()`` removes it. Use ``RestoreGate.open()``. CRIU closes every descriptor it does not
    know before it runs a script, so the verdict travels through a file and the wait through a lock:
    the engine holds the gate's lock (not inherited by CRIU) from its opening to its verdict."""

    def __init__(self, directory):
        self.directory = directory
        self.script = os.path.join(directory, "gate.sh")
        self._lock = None
        self.decided = None

    @classmethod
    def open(cls, places=PLACES):
        """A gate, or None where no place lets CRIU exec its script (every candidate noexec or refused)
        or this host has no flock(1) (util-linux)."""
        flock = shutil.which("flock", path=os.environ.get("PATH", "") + ":/usr/bin:/bin")
        if not flock or not SAFE_PATH.match(flock):
            return None
        for place in places:
            gate = cls._open_in(place, flock)
            if gate is not None:
                return gate
        return None

    @classmethod
    def _open_in(cls, place, flock):
        try:
            if os.statvfs(place).f_flag & os.ST_NOEXEC:
                return None
            directory = tempfile.mkdtemp(prefix="gpuckpt-restore-gate-", dir=place)
        except OSError:
            return None
        gate = cls(directory)
        try:
            if not SAFE_PATH.match(directory):
                raise OSError("the gate's directory %s cannot be quoted into its script" % directory)
            gate._lock = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(gate._lock, fcntl.LOCK_EX)
            fd = os.open(gate.script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700)
            with os.fdopen(fd, "w") as fh:
                fh.write(SCRIPT % {"dir": directory, "flock": flock})
            # An exec refused here (a mount's or a security module's policy) would fail CRIU's restore:
            # find out now, where it costs a millisecond, and check the image first instead.
            probe = subprocess.run([gate.script], env={"CRTOOLS_SCRIPT_ACTION": "gpuckpt-probe"}, timeout=10, check=False,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if probe.returncode == 0:
                return gate
        except (OSError, subprocess.SubprocessError):
            pass
        gate.close()
        return None

    @property
    def criu_args(self):
        return ["--action-script", self.script]

    def decide(self, ok):
        """The verdict, given once (a later call is ignored): written, then the lock let go."""
        if self.decided is not None:
            return
        self.decided = bool(ok)
        try:
            with open(os.path.join(self.directory, ".verdict.tmp"), "w") as fh:
                fh.write("ok\n" if ok else "fail\n")
            os.rename(os.path.join(self.directory, ".verdict.tmp"), os.path.join(self.directory, "verdict"))
        finally:
            self._unlock()

    def _unlock(self):
        if self._lock is not None:
            os.close(self._lock)  # the lock goes with the descriptor, which only this process holds
            self._lock = None

    def close(self):
        """Fail the gate if no verdict was given, and remove it."""
        if self.decided is None and self._lock is not None:
            self.decide(False)
        self._unlock()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
