# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Moving an image from this host to another: one path, over the hosts' own ssh.

A Sender opens ``streams`` ssh connections to the target, each ending in the receiver program
(receiver.py, sent as the stream's first bytes: the target needs Python 3 and nothing of ours
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

import hashlib
import json
import os
import queue
import re
import select
import shlex
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future

from ..core import bundle
from ..core import image
from ..core import procfs
from ..core.errors import GpuCkptError, InvalidTarget, TransactionError
from ..core.progress import BytesProgress
from . import receiver

CHUNK = image.CHUNK
HASHED_BLOCK = 2**20   # a piece hashed on its way goes in blocks read, hashed and written while in the core's cache
FENCE_EVERY = 8 * 2**20
FAST_CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"
GROWING = image.GROWING
HOST_RE = re.compile(r"^[A-Za-z0-9_.:%\[\]-]+\Z")
USER_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*\Z")
PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+-]+\Z")


def auto_streams(cpus=None):
    """A quarter of the cores this process may use (procfs.usable_cpus), 1 to 8. Each stream costs a
    core for its cipher on each end: on the 2-core CI kind of machine 4 streams were slower than 1."""
    return min(8, max(1, (cpus or procfs.usable_cpus()) // 4))


class Target(object):
    """Where an image goes: a host reached with ssh as ``user`` on ``port``, and the receiver's Python.
    Every value is checked here, since it becomes part of an ssh command line."""

    def __init__(self, host, user="root", port=22, ssh_args=(), python="python3", io_timeout=120, become=False):
        host = str(host or "")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address as an inventory may write it; ssh wants it bare
        if not HOST_RE.match(host) or host.startswith("-"):
            raise InvalidTarget("transfer host %r is not a host name or address" % host, stage="preflight")
        if not USER_RE.match(str(user or "")):
            raise InvalidTarget("transfer user %r is not a user name" % user, stage="preflight")
        if not PYTHON_RE.match(str(python or "")) or str(python).startswith("-"):
            raise InvalidTarget("transfer python %r must be a command name or an absolute path" % python,
                                stage="preflight")
        if not 0 < int(port) < 65536:
            raise InvalidTarget("transfer port %r is out of range" % port, stage="preflight")
        if int(io_timeout) < 1:
            raise InvalidTarget("io_timeout must be at least 1 second, got %r" % io_timeout, stage="preflight")
        self.host, self.user, self.port = host, str(user), int(port)
        self.ssh_args, self.python, self.io_timeout = [str(a) for a in ssh_args or ()], str(python), int(io_timeout)
        # A user other than root reaches the receiver through a passwordless sudo (the inventory's become):
        # it writes into root's image and journal directories.
        self.become = bool(become) and self.user != "root"

    def remote_command(self, *words):
        """The shell command that runs ``words`` on the target, through sudo when the target becomes root."""
        return "exec " + " ".join((["sudo", "-n", "--"] if self.become else []) + [shlex.quote(w) for w in words])

    def ssh(self):
        # The user's ssh arguments first: for ssh, the first value given for an option wins. AES-GCM is
        # preferred over OpenSSH's default chacha20-poly1305: on the CI kind of machine (AES-NI) one ssh
        # stream moved 1.06 GB/s with aes128-gcm against 0.69 GB/s with chacha20 (docs/benchmarks).
        # A target that stops answering is given up after about io_timeout seconds (the source may be
        # frozen meanwhile); one that does not answer at all, after the connect timeout.
        interval = max(1, min(15, self.io_timeout // 3))
        return ["ssh"] + self.ssh_args + [
            "-p", str(self.port), "-l", self.user, "-o", "BatchMode=yes", "-o", "Compression=no",
            "-o", "Ciphers=" + FAST_CIPHERS, "-o", "ServerAliveInterval=%d" % interval,
            "-o", "ServerAliveCountMax=%d" % max(1, self.io_timeout // interval),
            "-o", "ConnectTimeout=%d" % min(30, max(5, self.io_timeout)), "--", self.host]

    def __str__(self):
        return self.host


def receiver_program():
    """The receiver as one Python program (core/bundle.py): receiver.py and the modules of this package it imports,
    ending in receiver.main()."""
    main = "import sys\nfrom %s import main\nsys.exit(main())\n" % receiver.__name__
    return bundle.program(main, header="# gpuckpt receiver, bundled by gpuckpt.fleet (transfer/transfer.py)\n").encode("utf-8")


_BOOTSTRAP = "import sys; exec(compile(sys.stdin.buffer.read(%d), 'gpuckpt-receiver', 'exec'))"


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


class TransferError(TransactionError):
    """A transfer failed: which stream, the ssh command, and the receiver's own words. ``retryable``:
    whether another attempt may get through (a broken connection, a timeout); not when the target's
    disk is full or its receiver refused (another migration's nonce, a settled migration, an unsafe
    path), which the next attempt would meet again."""

    def __init__(self, msg, retryable=True, **kwargs):
        super(TransferError, self).__init__(msg, **kwargs)
        self.retryable = retryable


class Stream(object):
    """One ssh connection to the target, ending in a receiver."""

    def __init__(self, target, config, program, index):
        self.target, self.index = target, index
        self.err = tempfile.TemporaryFile()
        remote = target.remote_command(target.python, "-c", _BOOTSTRAP % len(program), json.dumps(config, sort_keys=True))
        self.cmd = target.ssh() + [remote]
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     start_new_session=True)
        receiver.widen_pipe(self.proc.stdin)  # fewer wake-ups of this sender and of ssh per byte sent
        self._write(program)
        self.ready = None
        self._block = None

    def _write(self, data):
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def reply(self, what):
        """The receiver's next reply line (JSON); its stderr in the error when the stream ends instead."""
        line = self.proc.stdout.readline()
        if not line:
            raise self.failure("the receiver ended while %s" % what)
        try:
            doc = json.loads(line)
        except ValueError:
            raise self.failure("the receiver answered %r while %s" % (line[:200], what))
        if doc.get("error"):
            raise self.failure("the receiver refused (%s)" % doc["error"], retryable=False, fenced=doc.get("fenced"),
                               answered=True)
        return doc

    def wait_ready(self):
        self.ready = self.reply("starting")
        return self.ready

    def send(self, header, path=None, off=0, length=0, bucket=None, fence=None, progress=None, hashing=False):
        """Send ``header``, then ``length`` bytes of ``path`` from ``off``: by the kernel (sendfile), or,
        ``hashing``, read and hashed on their way; then returns ((st_dev, st_ino), sha256 hex digest) of
        what went."""
        self._write((json.dumps(header) + "\n").encode())
        if path is None:
            return None
        with open(path, "rb") as fh:
            if hashing:
                return self._send_hashed(fh, path, off, length, bucket, fence, progress)
            done = 0
            while done < length:
                n = min(8 * 2**20 if bucket is None else 2**20, length - done)
                if fence is not None:
                    fence()
                sent = os.sendfile(self.proc.stdin.fileno(), fh.fileno(), off + done, n)
                if sent <= 0:
                    raise OSError("%s is shorter than expected at byte %d" % (path, off + done))
                if bucket is not None:
                    bucket.take(sent)  # what was sent, which a pipe may cut short of n
                done += sent
                if progress is not None:
                    progress.add(sent)

    def _send_hashed(self, fh, path, off, length, bucket, fence, progress):
        # One reading of the piece for both the stream and the manifest's checksum (ChunkHasher's pushed).
        st = os.fstat(fh.fileno())
        digest = hashlib.sha256()
        if self._block is None:
            self._block = memoryview(bytearray(HASHED_BLOCK))
        out, done = self.proc.stdin.fileno(), 0
        while done < length:
            if fence is not None and done % FENCE_EVERY == 0:
                fence()
            got = os.preadv(fh.fileno(), [self._block[:min(HASHED_BLOCK, length - done)]], off + done)
            if got <= 0:
                raise OSError("%s is shorter than expected at byte %d" % (path, off + done))
            view = self._block[:got]
            digest.update(view)
            while view:
                view = view[os.write(out, view):]
            if bucket is not None:
                bucket.take(got)
            done += got
            if progress is not None:
                progress.add(got)
        return (st.st_dev, st.st_ino), digest.hexdigest()

    def stderr(self):
        self.err.seek(0)
        return self.err.read().decode("utf-8", "replace").strip()[-3000:]

    def failure(self, msg, retryable=True, fenced=False, answered=False):
        """The TransferError of this stream, with the receiver's own words; not retryable when the target's disk
        is full (said in its stderr or its refusal) or the receiver exited refusing (receiver.REFUSED);
        details.fenced: a replica store's StaleEpoch. ``answered``: ssh and its Python ran, so the hint is not them."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        err = self.stderr()
        disk_full = any("No space left on device" in text or "Errno 28]" in text for text in (err, msg))
        retryable = retryable and not disk_full and self.proc.returncode != receiver.REFUSED
        said = [ln for ln in err.splitlines() if ln.startswith("gpuckpt receiver: ")]
        if said:  # the receiver's own words say more than the broken stream
            msg += " (%s)" % said[-1][len("gpuckpt receiver: "):]
        hint = ("free space on the target" if disk_full else "the receiver on %s ran and stopped for the reason above"
                % self.target if answered or said else "check that this host reaches %s over ssh and that its Python 3 "
                "runs" % self.target)
        return TransferError("transfer to %s, stream %d: %s%s" % (self.target, self.index, msg,
                                                                  ": the target's disk is full" if disk_full else ""),
                             retryable=retryable, stage="transfer", cmd=self.cmd[:-1] + ["<receiver>"],
                             rc=self.proc.returncode, details={"fenced": True} if fenced else None,
                             stderr=err, hint=hint)

    def close(self, timeout):
        """Send the end mark and wait for the receiver to exit; raises its failure."""
        try:
            self._write(b'{"op": "end"}\n')
            self.proc.stdin.close()
        except OSError as exc:
            raise self.failure("the stream broke (%s)" % exc)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.failure("the receiver did not end within %s s" % timeout)
        if rc != 0:
            raise self.failure("the receiver exited with rc=%s" % rc)

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass
        self.proc.wait()


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
                report = sender.finish(image_dir, files)
                report.update(attempts=attempts, bytes_total=total, bytes_transferred=sender.bytes_sent,
                              bytes_already_there=held, seconds=round(time.monotonic() - start, 3))
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
    """A replica store's operation ({"replica_op": "check"|"commit"|"list", ...}: replica.run_op) run by a receiver on
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
