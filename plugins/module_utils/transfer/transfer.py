# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Moving an image from this host to another: one path, over the hosts' own ssh.

A Sender opens ``streams`` ssh connections to the target (targets.Target; streams.Stream), each ending in the
receiver program (receiver.py, sent as the stream's first bytes: the target needs Python 3 and nothing of ours
installed). It sends the image's files as 64 MiB pieces, each one chunk of the manifest's checksums,
spread over the streams: one ssh stream is bound by one core's cipher (0.45 GB/s with chacha20 on the
GPU machine, about 1 GB/s with AES-GCM), so several add up. Then, on the first stream alone, once every
other stream has ended: the files' exact sizes (``fix``), then the manifest (``deliver``), so the
target holds a complete image or none.

Used two ways, the same code:
- during a checkpoint (gpu_checkpoint's ``push``): the streams open before anything is frozen;
  ``watch`` sends each completed piece of the page files while CRIU writes them, ``complete`` the
  rest once the dump ended, ``finish`` the manifest;
- after it (``send_image``, gpu_image_sync): what the target lacks, found by asking it for the
  checksums of what it holds (``sums``): a transfer that was cut resumes, and a repair after a
  verification failure sends only the chunks that differ.

In a migration the receivers check the target's journal (see receiver.py): the image goes only into
the directory that this migration created there, and only while the journal is receiving its image.
The manifest's checksums, verified on the target before any restore, prove the copy.
"""
from __future__ import annotations

import json
import os
import queue
import select
import threading
import time
from concurrent.futures import Future

from ..core import image
from ..core import procfs
from ..core.errors import GpuCkptError
from ..core.progress import BytesProgress
from .streams import Stream, TransferError, receiver_program

CHUNK = image.CHUNK
GROWING = image.GROWING


def auto_streams(cpus=None):
    """A quarter of the cores this process may use (procfs.usable_cpus), 1 to 8. Each stream costs a
    core for its cipher on each end: on the 2-core CI kind of machine 4 streams were slower than 1."""
    return min(8, max(1, (cpus or procfs.usable_cpus()) // 4))


class TokenBucket(object):
    """A bandwidth limit shared by every stream: ``rate`` bytes per second (0: none)."""

    def __init__(self, rate):
        self.rate = float(rate or 0)
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n):
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - n / self.rate - now
        if wait > 0:
            time.sleep(wait)


class Sender(object):
    """Send one image to ``dest`` on ``target`` (see the module doc).

    ``receiver``: what the receivers check: {"migration_id", "journal_dir", "nonce"} in a migration,
    else {"image_id"}. ``before_deliver``: called right before the manifest is sent (the source's
    journal records that the image may reach the target from here on). ``fence``: called often;
    raises to stop the transfer (a recovery fenced the migration)."""

    def __init__(self, target, dest, streams=0, receiver=None, bwlimit_kbps=0, progress=None,
                 before_deliver=None, fence=None, piece=None):
        self.target, self.dest = target, dest
        self.streams = streams if streams and streams > 0 else auto_streams()
        self.config = dict(receiver or {}, dest=dest, chunk=CHUNK)
        self.bucket = TokenBucket(bwlimit_kbps * 1024) if bwlimit_kbps else None
        self.progress = progress
        self.before_deliver, self.fence = before_deliver, fence
        self.piece = piece or CHUNK
        self.open_streams = []
        self.digests = None  # take_checksums()
        self.queue = queue.Queue()
        self.threads, self.errors = [], []
        self.sent_upto = {}  # rel -> bytes queued from the start of the file
        self.skip = {}       # rel -> chunk offsets the target already holds (from sums)
        self.bytes_sent = self.bytes_before_complete = 0
        self._final = None
        self.finish_steps = None
        self._lock = threading.Lock()
        self._watching = None
        self._stop_watch = threading.Event()
        self.started = None

    # -- streams ------------------------------------------------------------------------------------
    def start(self):
        """Open the streams and wait until every receiver is ready (the first alone first: outside a
        migration it creates the destination)."""
        self.started = time.monotonic()
        program = receiver_program()
        try:
            for i in range(self.streams):
                s = Stream(self.target, self.config, program, i)
                self.open_streams.append(s)
                if i == 0:
                    s.wait_ready()
            for s in self.open_streams[1:]:
                s.wait_ready()
        except (OSError, GpuCkptError) as exc:
            self.abort()
            if isinstance(exc, GpuCkptError):
                raise
            raise TransferError("transfer to %s could not start: %s" % (self.target, exc), stage="transfer")
        for s in self.open_streams:
            t = threading.Thread(target=self._sender, args=(s,), name="gpuckpt-send-%d" % s.index)
            t.daemon = True
            t.start()
            self.threads.append(t)
        return self

    def _sender(self, stream):
        while True:
            item = self.queue.get()
            taken = None
            try:
                if item is None:
                    return
                root, rel, off, length, digest = item
                if self.errors:
                    continue  # a stream failed: this attempt is lost anyway, drain the queue
                # (a piece cut half-way was counted in progress; each attempt of send_image starts the
                # count again from what the target holds)
                sent = stream.send({"op": "data", "path": rel, "off": off, "len": length}, os.path.join(root, rel), off,
                                   length, self.bucket, self.fence, self.progress, hashing=digest is not None)
                taken = None if digest is None else (sent[0], length, sent[1])
                with self._lock:
                    self.bytes_sent += length
            except (OSError, ValueError) as exc:
                self.errors.append(stream.failure("the stream broke (%s)" % exc))
            except GpuCkptError as exc:
                self.errors.append(exc)
            except Exception as exc:  # noqa: BLE001 - any failure ends this attempt, never the thread silently
                self.errors.append(TransferError("transfer to %s, stream %d: %r" % (self.target, stream.index, exc),
                                                 stage="transfer"))
            finally:
                if item is not None and item[4] is not None:
                    _settle(item[4], taken)  # None: not sent, the checkpoint hashes that chunk itself
                self.queue.task_done()

    def _raise_first_error(self):
        if self.errors:
            raise self.errors[0]

    # -- what to send -------------------------------------------------------------------------------
    def take_checksums(self):
        """Have the push hash each chunk it sends, as it reads it to send it: {(rel, chunk index): future of
        ((st_dev, st_ino), length, sha256 hex digest), or None where it was not sent}, for the checkpoint's
        chunk_hasher.ChunkHasher (``pushed``). None when the pieces are not the manifest's chunks."""
        if self.piece == CHUNK and self.digests is None:
            self.digests = {}
        return self.digests

    def _queue_ranges(self, image_dir, rel, upto, during):
        start = self.sent_upto.get(rel, 0)
        skip = self.skip.get(rel, ())
        while start < upto:
            n = min(self.piece, upto - start)
            if during and n < self.piece:
                break  # only whole pieces while the file still grows
            if start not in skip:
                digest = None
                if self.digests is not None:
                    digest = self.digests[(rel, start // CHUNK)] = Future()
                self.queue.put((image_dir, rel, start, n, digest))
            start += n
        self.sent_upto[rel] = start

    def watch(self, image_dir):
        """Send the completed pieces of the growing page files until complete() or abort()."""
        def loop():
            while not self._stop_watch.wait(0.02):
                try:
                    for rel, st in image.walk(image_dir).items():
                        if GROWING.match(os.path.basename(rel)):
                            self._queue_ranges(image_dir, rel, st.st_size - st.st_size % self.piece, True)
                except (OSError, GpuCkptError):
                    pass  # a file went away (a failed dump is being discarded)
        self._watching = threading.Thread(target=loop, name="gpuckpt-send-watch")
        self._watching.daemon = True
        self._watching.start()

    def _stop_watching(self):
        self._stop_watch.set()
        if self._watching is not None:
            self._watching.join()

    def resume(self, manifest):
        """Ask the target what it already holds of the image (the checksums of its chunks) and send
        only the chunks that differ or are missing: a cut transfer resumes, a repair sends what is bad."""
        files = manifest.get("files") or {}
        s = self.open_streams[0]
        s.send({"op": "sums", "files": sorted(files)})
        have = s.reply("reading what the target holds").get("sums") or {}
        for rel, meta in files.items():
            got = (have.get(rel) or {}).get("sha256_chunks") or []
            self.skip[rel] = {i * CHUNK for i, (want, h) in enumerate(zip(meta["sha256_chunks"], got)) if want == h
                              and (have[rel]["size"] >= min((i + 1) * CHUNK, meta["size"]))}
        return sum(min(CHUNK, files[r]["size"] - off) for r in self.skip for off in self.skip[r] if files[r]["size"])

    def complete(self, image_dir, files=None):
        """The image's files are final (the dump ended): queue all that is not sent yet, largest first."""
        if self._final is not None:
            return
        self._stop_watching()
        self.bytes_before_complete = self.bytes_sent
        self._final = {rel: st.st_size for rel, st in image.walk(image_dir).items()} if files is None else files
        for rel, size in sorted(self._final.items(), key=lambda kv: -kv[1]):
            self._queue_ranges(image_dir, rel, size, False)

    def finish(self, image_dir, files=None):
        """Send the rest of the complete image, then its sizes, then its manifest. Returns a report."""
        self.complete(image_dir, files)
        clock = _Steps()
        for _s in self.open_streams:
            self.queue.put(None)
        self.queue.join()
        for t in self.threads:
            t.join()
        clock.mark("sent")
        self._raise_first_error()
        first, rest = self.open_streams[0], self.open_streams[1:]
        for s in rest:  # every other stream has written all it carried
            s.close(self.target.io_timeout)
        clock.mark("streams_closed")
        if self.fence is not None:
            self.fence()
        first.send({"op": "fix", "files": sorted([rel, size] for rel, size in self._final.items())})
        mpath = os.path.join(image_dir, image.MANIFEST)
        size = os.path.getsize(mpath)
        if self.before_deliver is not None:
            self.before_deliver()
        clock.mark("before_deliver")
        first.send({"op": "deliver", "len": size}, mpath, 0, size)
        first.reply("delivering the manifest")
        clock.mark("delivered")
        first.close(self.target.io_timeout)
        clock.mark("closed")
        self.bytes_sent += size
        self.finish_steps = clock.steps
        return self.report()

    def report(self):
        out = {"dest_host": self.target.host, "dest": self.dest, "streams": self.streams,
               "bytes": self.bytes_sent, "bytes_sent_during_dump": self.bytes_before_complete,
               "seconds": round(time.monotonic() - (self.started or time.monotonic()), 3)}
        if self.finish_steps:  # where the end of the push went (seconds of each step after the last piece was queued)
            out["finish_steps"] = self.finish_steps
        return out

    def abort(self):
        """Stop at once: kill the streams; the receivers exit without delivering a manifest."""
        self._stop_watching()
        for s in self.open_streams:
            s.kill()
        for _t in self.threads:
            self.queue.put(None)  # let each sender thread end
        for fut in list((self.digests or {}).values()):
            _settle(fut, None)  # whoever waits for a checksum of the push hashes that chunk itself


class _Steps(object):
    """Seconds between marks, by the name of the step each mark ends."""

    def __init__(self):
        self.last, self.steps = time.monotonic(), {}

    def mark(self, name):
        now = time.monotonic()
        self.steps[name] = round(now - self.last, 3)
        self.last = now


def _settle(future, value):
    """Give ``future`` its value unless it has one (a sender thread and abort() may both try)."""
    try:
        future.set_result(value)
    except Exception:  # noqa: BLE001 - concurrent.futures.InvalidStateError: it was settled already
        pass


def send_image(image_dir, target, dest, receiver=None, streams=0, bwlimit_kbps=0, retries=3, retry_delay=1.0,
               progress_file=None, before_deliver=None, fence=None):
    """Send the complete image ``image_dir`` to ``dest`` on ``target``: what the target lacks, then
    the manifest; retried (and resumed) up to ``retries`` times. Returns a report."""
    manifest = image.load_manifest(image_dir)
    files = {rel: meta["size"] for rel, meta in (manifest.get("files") or {}).items()}
    total = sum(files.values())
    progress = BytesProgress(total, progress_file)
    progress.start()
    start, attempts, last = time.monotonic(), 0, None
    try:
        while attempts <= retries:
            attempts += 1
            sender = Sender(target, dest, streams, receiver, bwlimit_kbps, progress, before_deliver, fence)
            try:
                sender.start()
                held = sender.resume(manifest)
                progress.set(held, force=True)
                data_start = time.monotonic()  # (the streams are open and the target said what it holds)
                report = sender.finish(image_dir, files)
                now = time.monotonic()
                report.update(attempts=attempts, bytes_total=total, bytes_transferred=sender.bytes_sent,
                              bytes_already_there=held, seconds=round(now - start, 3),
                              data_seconds=round(now - data_start, 3))
                return report
            except (OSError, TransferError) as exc:
                sender.abort()
                last = exc if isinstance(exc, GpuCkptError) else TransferError(str(exc), stage="transfer")
                if not last.retryable or attempts > retries:
                    break
                time.sleep(retry_delay)
            except GpuCkptError:
                sender.abort()
                raise
    finally:
        progress.close()
    last.msg = "transfer to %s:%s failed after %d attempt(s): %s" % (target, dest, attempts, last.msg)
    raise last


def replica_call(target, config, timeout=60):
    """A replica store's operation ({"replica_op": "check"|"commit"|"list", ...}: replica_images.run_op) run by a receiver on
    ``target``: its reply. A fence comes back as {"ready": False, "fenced": True, "error"}; a failure raises."""
    try:
        stream = Stream(target, config, receiver_program(), 0)
    except OSError as exc:
        raise TransferError("the replica store on %s could not start: %s" % (target, exc), stage="transfer")
    try:
        ready = select.select([stream.proc.stdout], [], [], timeout)[0]
        line = stream.proc.stdout.readline() if ready else b""
        doc = json.loads(line) if line.startswith(b"{") else {}
        if not (doc.get("ready") or doc.get("fenced")):
            raise stream.failure("the replica store %s" % ("refused (%s)" % doc["error"] if doc.get("error") else
                                 "did not answer within %s s" % timeout if not ready else "ended without an answer"))
        if doc.get("ready"):
            stream.close(timeout)
        return doc
    finally:
        stream.kill()
