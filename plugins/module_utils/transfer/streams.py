# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One ssh stream of a transfer (Stream): the connection to the target, ending in the receiver program
(receiver_program: receiver.py and the modules it imports, bundled by core/bundle.py and sent as the stream's
first bytes), the framed operations written to it, the receiver's replies, and its failure (TransferError) in
the receiver's own words."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile

from ..core import bundle
from ..core.errors import TransactionError
from . import receiver

HASHED_BLOCK = 2**20   # a piece hashed on its way goes in blocks read, hashed and written while in the core's cache
FENCE_EVERY = 8 * 2**20


def receiver_program():
    """The receiver as one Python program (core/bundle.py): receiver.py and the modules of this package it imports,
    ending in receiver.main()."""
    main = "import sys\nfrom %s import main\nsys.exit(main())\n" % receiver.__name__
    return bundle.program(main, header="# gpuckpt receiver, bundled by gpuckpt.fleet (transfer/streams.py)\n").encode("utf-8")


_BOOTSTRAP = "import sys; exec(compile(sys.stdin.buffer.read(%d), 'gpuckpt-receiver', 'exec'))"


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
