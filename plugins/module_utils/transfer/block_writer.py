# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The receiver's data path (receiver.Receiver.data): the bytes of a data operation are read from the stream into
blocks of a small pool, which a writer thread (BlockWriter) writes and hashes while the next blocks are read.
Standard library only: the receiver program carries this file (core/bundle.py)."""
from __future__ import annotations

import json
import os
import queue
import threading

# A data operation's bytes are read from the stream into blocks of a small pool, which a writer thread writes
# and hashes while the next blocks are read: reading, writing and hashing one after another in one thread left
# each stream at a fraction of what its ssh carries (bench/push_bench.py).
RECEIVE_BLOCK = 2**20
RECEIVE_BLOCKS = 8


class BlockWriter(object):
    """Writes (pwrite) and hashes the blocks of data operations in a thread of its own, in the order given,
    and appends each operation's receipt once all its bytes are written. The first failure (a full disk) is
    kept and raised in the reading thread by check(); the blocks after it are dropped."""

    def __init__(self, receipt_fd):
        self.receipt_fd = receipt_fd
        self.free, self.work = queue.Queue(), queue.Queue()
        for _unused in range(RECEIVE_BLOCKS):
            self.free.put(memoryview(bytearray(RECEIVE_BLOCK)))
        self.error = None
        self.thread = threading.Thread(target=self._run, name="gpuckpt-receive-writer")
        self.thread.daemon = True
        self.thread.start()

    def _run(self):
        while True:
            item = self.work.get()
            if item is None:
                return
            kind = item[0]
            try:
                if self.error is None and kind == "block":
                    _kind, fd, block, n, off, digest = item
                    view = block[:n]
                    digest.update(view)
                    while view:
                        written = os.pwrite(fd, view, off)
                        view, off = view[written:], off + written
                elif self.error is None and kind == "receipt":
                    _kind, path, start, total, digest = item
                    line = json.dumps({"path": path, "off": start, "len": total, "sha256": digest.hexdigest()}) + "\n"
                    os.write(self.receipt_fd, line.encode())
            except BaseException as exc:  # noqa: BLE001 - raised again in the reading thread by check()
                self.error = exc
            finally:
                if kind == "block":
                    self.free.put(item[2])
                elif kind == "sync":
                    item[1].set()

    def block(self):
        """A free block to read into (waits while all are being written)."""
        self.check()
        return self.free.get()

    def write(self, fd, block, n, off, digest):
        self.work.put(("block", fd, block, n, off, digest))

    def receipt(self, path, start, total, digest):
        self.work.put(("receipt", path, start, total, digest))

    def check(self):
        if self.error is not None:
            raise self.error

    def sync(self):
        """Wait until everything given so far is written; raise its failure."""
        done = threading.Event()
        self.work.put(("sync", done))
        done.wait()
        self.check()

    def stop(self):
        self.work.put(None)
        self.thread.join()
