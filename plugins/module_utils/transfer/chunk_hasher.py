# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The manifest's checksums taken while the image is written (a checkpoint's), not after it: see ChunkHasher."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..core.errors import ImageError
from ..core.fsutil import UnsafePath, open_beneath, open_dir
from ..core import image
from ..core.procfs import usable_cpus


class ChunkHasher(object):
    """The manifest's checksums, taken while the runtime writes the image: each whole chunk of a
    growing page file is hashed as soon as it is written (CRIU only appends to them), so that once
    the dump ends only the last chunks and the small files are left to hash, not the whole image.

    ``pushed``: where the image is pushed while it is written (transfer.Sender.take_checksums), the
    push's own digests, {(rel, chunk index): future of ((st_dev, st_ino), length, digest) or None}: the
    push reads every chunk once to send it and hashes it as it goes, so nothing reads the image a second
    time beside the dump and the ciphers (on 8 cores, that second reading left 7.6 s of hashing after a
    26 GB dump, docs/benchmarks session 20). Nothing is then hashed early here; what the push could not
    hash (a broken stream, an empty file) is hashed at the end.

    ``follow()`` starts hashing; ``checksums()`` stops following and returns what image.checksum_files
    would. A chunk hashed early is used only if its file is still the same inode and its chunk as long;
    anything else is hashed again at the end. ``stop()`` (idempotent) ends it on any path."""

    def __init__(self, image_dir, workers=None, poll=0.05, pushed=None):
        self.image_dir = image_dir
        self.poll = poll
        self.pushed = pushed
        # A quarter of the cores: the dump and the push's ciphers run beside it, and one thread hashes
        # faster (about 1.8 GB/s) than CRIU writes; what falls behind is hashed on all cores at the end.
        self.pool = ThreadPoolExecutor(workers or max(1, min(8, usable_cpus() // 4)))
        self.early = {}        # (rel, chunk index) -> future of its digest
        self.inodes = {}       # rel -> (st_dev, st_ino) its early chunks were read from
        self.fds = {}
        self._stop = threading.Event()
        self._thread = None
        self._dir_fd = None

    def follow(self):
        if self.pushed is not None:
            return self  # the push hashes what it sends
        self._dir_fd = open_dir(self.image_dir)
        self._thread = threading.Thread(target=self._loop, name="gpuckpt-hash-follow")
        self._thread.daemon = True
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.poll):
            try:
                for rel, st in image.walk(self.image_dir).items():
                    if image.GROWING.match(os.path.basename(rel)):
                        self._hash_whole_chunks(rel, st)
            except (OSError, ImageError, UnsafePath):
                pass  # a file went away (a failed dump is being discarded): checksums() decides

    def _hash_whole_chunks(self, rel, st):
        ident = (st.st_dev, st.st_ino)
        if self.inodes.setdefault(rel, ident) != ident:
            return  # replaced while we followed it: all of it is hashed at the end
        if rel not in self.fds:
            self.fds[rel] = open_beneath(self._dir_fd, rel)
        for i in range(st.st_size // image.CHUNK):
            if (rel, i) not in self.early:
                self.early[(rel, i)] = self.pool.submit(image._hash_range, self.fds[rel], i * image.CHUNK, image.CHUNK)

    def _stop_following(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def checksums(self, files=None):
        self._stop_following()
        try:
            final = image.checksum_files(self.image_dir, files, known=self._known())
        finally:
            self.stop()
        return final

    def _known(self):
        known = {}
        for (rel, i), fut in self.early.items():
            try:
                known[(rel, i, self.inodes[rel])] = (image.CHUNK, fut.result())
            except (OSError, ValueError):
                pass  # hashed again at the end
        for (rel, i), fut in list((self.pushed or {}).items()):
            try:
                taken = fut.result()  # (the push ends, or fails, within its streams' io_timeout)
            except Exception:  # noqa: BLE001 - a piece the push could not send is hashed here
                continue
            if taken is not None:
                ident, length, digest = taken
                known[(rel, i, tuple(ident))] = (length, digest)
        return known

    def hashed_early(self):
        """The bytes hashed before the last pass: early here, or by the push."""
        done = sum(1 for f in self.early.values() if f.done() and not f.exception()) * image.CHUNK
        for fut in list((self.pushed or {}).values()):
            if fut.done() and not fut.exception() and fut.result() is not None:
                done += fut.result()[1]
        return done

    def stop(self):
        self._stop_following()
        for fut in self.early.values():
            fut.cancel()  # an abandoned dump: do not hash the rest of it
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
