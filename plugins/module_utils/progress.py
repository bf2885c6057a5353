# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Progress of a long module run, written as JSON to a file on the managed host about every second.

A module cannot print while it runs; the collection's action plugins (on the controller) poll this
file and print a line per change, so a user watching a 70 GB job in AWX sees it move. Plain Python.
"""
from __future__ import annotations

import json
import os
import threading
import time


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
            data = dict(self.fields(), updated=time.time())
            tmp = "%s.%d.tmp" % (self.path, os.getpid())
            try:
                with open(tmp, "w") as fh:
                    json.dump(data, fh)
                os.chmod(tmp, 0o644)  # the controller may poll it without become
                os.replace(tmp, self.path)
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
        the next run removes those not updated for an hour."""
        folder, name = os.path.split(self.path)
        if not name.startswith(STALE_PREFIX):
            return
        try:
            for other in os.listdir(folder or "."):
                full = os.path.join(folder, other)
                if other.startswith(STALE_PREFIX) and full != self.path and \
                        time.time() - os.lstat(full).st_mtime > age:
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
