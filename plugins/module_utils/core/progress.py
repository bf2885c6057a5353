# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Progress of a long module run, written as JSON to a file on the managed host about every second.

A module cannot print while it runs; the collection's action plugins (on the controller) poll this
file and print a line per change, so a user watching a 70 GB job in AWX sees it move. Plain Python.
"""
from __future__ import annotations

import os
import stat
import threading
import time

from .fsutil import atomic_write


STALE_PREFIX = ".gpuckpt-progress-"  # the action plugins' names, in /tmp


def _dir_bytes(path):
    total = 0
    try:
        for root, dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total


class ProgressFile(object):
    """Atomically rewritten JSON: ``fields()`` of the owner plus ``updated``; a ticker thread keeps
    it fresh while a stage runs. Removed by ``close()``. A None path makes every call a no-op."""

    def __init__(self, path, every=1.0):
        self.path, self.every = path, every
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def fields(self):
        return {}

    def write(self):
        if not self.path:
            return
        with self._lock:
            # Who writes it: a controller waiting on this module can tell a dead job from a slow one.
            data = dict(self.fields(), updated=time.time(), pid=os.getpid(), starttime=_starttime())
            try:
                # A new file with a random name, renamed over the path: a symlink planted at the path (or
                # at any name beside it) is replaced, never written through. World-readable: the
                # controller may poll it without become; it holds stage names and byte counts only.
                atomic_write(self.path, data, mode=0o644)
            except OSError:
                pass  # progress is a courtesy; it never fails the job

    def start(self):
        if not self.path or self._thread:
            return
        self._remove_stale()
        self.write()

        def tick():
            while not self._stop.wait(self.every):
                self.write()
        self._thread = threading.Thread(target=tick, name="gpuckpt-progress")
        self._thread.daemon = True
        self._thread.start()

    def _remove_stale(self, age=3600):
        """Progress files of runs that were killed (a controller gone mid-transfer) are left behind;
        the next run removes those not updated for an hour: only our own regular files."""
        folder, name = os.path.split(self.path)
        if not name.startswith(STALE_PREFIX):
            return
        try:
            for other in os.listdir(folder or "."):
                full = os.path.join(folder, other)
                if not other.startswith(STALE_PREFIX) or full == self.path:
                    continue
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and time.time() - st.st_mtime > age:
                    os.unlink(full)
        except OSError:
            pass

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(2 * self.every)
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _starttime():
    try:
        with open("/proc/self/stat") as fh:
            data = fh.read()
        return int(data[data.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class StageProgress(ProgressFile):
    """Which stage of ``order`` runs, since when, what took how long, and the image's size so far."""

    def __init__(self, path, order, watch_dir=None, every=1.0):
        super(StageProgress, self).__init__(path, every)
        self.order, self.watch_dir = list(order), watch_dir
        self.done, self.since = {}, time.time()

    def fields(self):
        running = next((s for s in self.order if s not in self.done), None)
        out = {"kind": "stages", "running": running, "since": self.since, "done": dict(self.done)}
        if self.watch_dir:
            out["image_bytes"] = _dir_bytes(self.watch_dir)
        return out

    def stage_done(self, stage, seconds):
        self.done[stage] = seconds
        self.since = time.time()
        self.write()


class BytesProgress(ProgressFile):
    """Bytes moved out of a total; ``add`` is thread-safe."""

    def __init__(self, total, path=None, every=1.0):
        super(BytesProgress, self).__init__(path, every)
        self.total, self.done, self.started = total, 0, time.time()
        self._count_lock = threading.Lock()

    def fields(self):
        return {"kind": "bytes", "bytes_done": self.done, "bytes_total": self.total, "started": self.started}

    def add(self, n, force=False):
        with self._count_lock:
            self.done += n
        if force:
            self.write()

    def set(self, n, force=False):
        with self._count_lock:
            self.done = n
        if force:
            self.write()
