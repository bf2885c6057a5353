# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The receiving end of an image transfer, run on the target at the end of each ssh stream.

The sender (transfer.py, through streams.Stream) starts it as ``python3 -c <bootstrap> <config JSON>``; the bootstrap reads
this program (this module and the modules it imports, bundled by streams.receiver_program) from
the stream's first bytes, then the stream carries framed operations: a JSON header line, and for
``data`` and ``deliver`` that many bytes.

  data     write a byte range in place (pwrite); its SHA-256 goes into this receiver's receipt
  sums     reply with the SHA-256 of each 64 MiB chunk of the given files as they are here (resume, repair)
  fix      cut each file to its exact size and record its identity (image.file_identity)
  deliver  the manifest: checked, then written (atomically) as the image's last file
  end      done

A push into a replica store (replica/replica.py, replica_images.py; config ``replica``: {"root", "job", "epoch", "node"}) is an image
push whose dest must be <root>/<job>/<image_id>: the store's check_push runs before the directory is created
(a fenced copy's push is refused, with ``fenced`` in the reply) and again, under the job's lock, before the
manifest is written. Config ``replica_op`` ("check", "commit", "list") runs that operation of the store instead
and replies one JSON line.

A probe of the link (gpu_image_sync's ``probe_mib``): config ``probe`` receives a scratch image like any
other, into a new directory named ``.gpuckpt-probe-*`` whose mark says it is a probe's; config
``remove_probe`` then removes that directory, and nothing else (see remove_probe_dir), and ends.

What it refuses to do, whoever sends what:
- write anywhere but below the image dir, which it opens once (O_NOFOLLOW) and checks: in a migration,
  the dir the target's journal says this migration created (same device and inode), while the journal
  is still receiving this migration's image (its nonce). A rollback that cleaned the target (phase
  ``cleaned``) stops every receiver still running: new ones refuse to start, old ones are killed by it
  (their pids are in the journal), and a straggler's writes go to a removed directory;
- write through a symlink, into the state dir, or the manifest with ``data`` or ``fix``: every path a sender names
  goes through image_rel (normalised first, then refused when empty, absolute, with ``..`` or a NUL, or when it
  falls into the state dir or onto the manifest), also the paths of ``sums``;
- change an image a replica store committed (its replica.json): a push of that id is refused, also one that was
  already open when the commit came (before each data or fix operation, and before the manifest);
- deliver a manifest of another image (another migration's nonce, another image id).
Files are created 0600 in a 0700 dir: nobody else reads the workload's memory while it arrives.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import sys
import time

from ..core import image
from ..core.errors import GpuCkptError
from ..core.fsutil import (UnsafePath, atomic_write, create_private_dir, identity, open_beneath, open_dir, read_json,
                           remove_tree)
from ..core.journal import Journal, process_identity
from ..replica import replica, replica_images
from .block_writer import RECEIVE_BLOCK, BlockWriter

RECEIVE_PHASES = ("receiving", "received", "restore_failed")
TRANSFER_MARK = "transfer.json"  # outside a migration: which image this dir is receiving
# The name of a probe's scratch image: a receiver removes a directory only when it is named so and marked
# as the probe's that created it.
PROBE_PREFIX = ".gpuckpt-probe-"
# The exit status of a receiver that refused: the sender does not try again what would be refused again.
REFUSED = 2
# The stream's pipe from sshd (and the sender's into ssh), widened from 64 KiB: fewer wake-ups per byte.
PIPE_SIZE = 2**20
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, Linux (the fcntl module names it only from Python 3.10)


class Refused(Exception):
    """What this receiver will not do, whoever asks again (another migration's nonce, an unsafe path)."""


class StreamCut(Exception):
    """The stream ended before what it announced: a broken connection, which another attempt may get past."""


class Receiver(object):
    def __init__(self, config, inp, out):
        self.config, self.inp, self.out = config, inp, out
        self.dest = os.path.abspath(config["dest"]) if config.get("dest") else None  # none for a replica_op
        self.chunk = int(config.get("chunk") or image.CHUNK)
        image.CHUNK = self.chunk  # the sender's chunks are the manifest's: hash the same ranges
        self.fds, self.fixed = {}, {}
        self.dir_fd = self.state_fd = self.receipt_fd = None
        self.journal = None
        self.writer = None

    # -- opening the destination ----------------------------------------------------------------------
    def open(self):
        if self.config.get("migration_id"):
            self._open_for_migration()
        else:
            self._check_replica()
            self._open_for_image()
            if self.config.get("replica"):
                replica.check_image_parent(self.config["replica"]["root"], self.config["replica"]["job"], self.dir_fd)
        try:
            os.mkdir(image.STATE_DIR, 0o700, dir_fd=self.dir_fd)
        except FileExistsError:
            pass
        self.state_fd = open_beneath(self.dir_fd, image.STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
        self._refuse_committed()
        name = "%s%d-%s.jsonl" % (image.RECEIPT_PREFIX, os.getpid(), os.urandom(4).hex())
        self.receipt_fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=self.state_fd)

    def _open_for_migration(self):
        c = self.config
        self.journal = Journal(c.get("journal_dir"), c["migration_id"], "target")
        with self.journal.hold(wait=60, purpose="a transfer's receiver"):
            doc = self.journal.read()
            if not doc or doc.get("phase") not in RECEIVE_PHASES:
                raise Refused("migration %s is not receiving an image on this host (journal phase %s)"
                              % (c["migration_id"], (doc or {}).get("phase")))
            if doc.get("nonce") != c.get("nonce"):
                raise Refused("migration %s on this host expects the image of another checkpoint (nonce differs)"
                              % c["migration_id"])
            if os.path.abspath(doc.get("image_dir") or "") != self.dest:
                raise Refused("migration %s receives into %s on this host, not %s"
                              % (c["migration_id"], doc.get("image_dir"), self.dest))
            self.dir_fd = open_dir(self.dest)
            if identity(os.fstat(self.dir_fd)) != list(doc.get("image_dir_identity") or []):
                raise Refused("%s is not the directory migration %s created on this host" % (self.dest, c["migration_id"]))
            receivers = dict(doc.get("receivers") or {})
            receivers[str(os.getpid())] = process_identity(os.getpid())
            self.journal.record(receivers=receivers)

    def _check_replica(self):
        """A push into a replica store: into <root>/<job>/<image_id> alone, and only while the store takes it."""
        r = self.config.get("replica")
        if not r:
            return
        if not isinstance(r, dict) or not r.get("root"):
            raise Refused("a push into a replica store names its root, job, epoch and node")
        want = os.path.join(os.path.abspath(r["root"]), replica.check_job(r.get("job")),
                            replica.check_image_id(self.config.get("image_id")))
        if self.dest != want:
            raise Refused("a push into the replica store goes to %s, not %s" % (want, self.dest))
        replica.check_push(r["root"], r["job"], r.get("epoch"), r.get("node"))

    def _refuse_committed(self):
        """A push into a replica store changes nothing of an image the store committed (its replica mark is there):
        checked when the push opens the image, before each data and fix operation, and under the job's lock before
        the manifest (a commit writes the mark under that lock)."""
        if not self.config.get("replica") or self.state_fd is None:
            return
        try:
            os.stat(replica_images.REPLICA_MARK, dir_fd=self.state_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        raise Refused("image %s of job %s was committed on this replica (it has its %s): a push never changes a "
                      "committed image; push a new image id" % (self.config.get("image_id"),
                                                                self.config["replica"].get("job"),
                                                                replica_images.REPLICA_MARK))

    def _open_for_image(self):
        want, probe = self.config.get("image_id"), bool(self.config.get("probe"))
        mark = {"image_id": want}
        mark.update({"probe": True} if probe else {})
        if self.config.get("replica"):  # who pushed it, for a listing of an image whose push was cut
            mark["replica"] = {k: self.config["replica"].get(k) for k in ("epoch", "node")}
        if probe:
            check_probe_dir(self.dest)
        try:
            create_private_dir(self.dest)
            self.dir_fd = open_dir(self.dest)
            os.mkdir(image.STATE_DIR, 0o700, dir_fd=self.dir_fd)
            state = open_beneath(self.dir_fd, image.STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
            try:
                atomic_write(TRANSFER_MARK, mark, dir_fd=state)
            finally:
                os.close(state)
            return
        except FileExistsError:
            pass
        self.dir_fd = open_dir(self.dest)
        st = os.fstat(self.dir_fd)
        mark = read_json(os.path.join(image.STATE_DIR, TRANSFER_MARK), dir_fd=self.dir_fd) or {}
        if st.st_uid != os.geteuid():
            raise Refused("%s belongs to uid %d; refusing to write an image into it" % (self.dest, st.st_uid))
        ours = mark.get("image_id") == want and bool(mark.get("probe")) == probe
        # (a probe writes only into the directory its first stream created: removing it later must remove nothing else)
        if not ours and (probe or os.listdir(self.dir_fd)):
            raise Refused("%s holds something other than an unfinished transfer of image %s; refusing to mix them"
                          % (self.dest, want))

    # -- operations ----------------------------------------------------------------------------------
    def _file(self, rel):
        """An fd open for writing on the image's file ``rel`` (image_rel: never the state dir, the manifest or
        outside the image), while no replica mark says the image was committed."""
        rel = image_rel(rel)
        self._refuse_committed()
        if rel not in self.fds:
            fd = open_beneath(self.dir_fd, rel, os.O_WRONLY | os.O_CREAT, 0o600, make_dirs=True)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise Refused("%s is not a regular file here" % rel)
            self.fds[rel] = fd
        return self.fds[rel]

    def _read(self, n, what):
        data = self.inp.read(n)
        if len(data) != n:
            raise StreamCut("the stream was cut in %s (%d of %d bytes)" % (what, len(data), n))
        return data

    def _reply(self, doc):
        self.out.write((json.dumps(doc) + "\n").encode())
        self.out.flush()

    def data(self, op):
        """Read the operation's bytes into blocks the writer writes and hashes meanwhile; its receipt follows
        them. A stream cut part-way leaves the bytes read so far written, and no receipt of the range."""
        fd, off, left = self._file(op["path"]), int(op["off"]), int(op["len"])
        if self.writer is None:
            self.writer = BlockWriter(self.receipt_fd)
        digest, start, total = hashlib.sha256(), off, left
        while left:
            block = self.writer.block()
            want, got = min(left, RECEIVE_BLOCK), 0
            while got < want:
                n = self.inp.readinto(block[got:want])
                if not n:
                    break
                got += n
            if got:
                self.writer.write(fd, block, got, off, digest)
            else:
                self.writer.free.put(block)
            if got < want:
                self.writer.sync()  # what came before the cut is written, with the receipts of whole ranges
                raise StreamCut("the stream was cut in %s at byte %d" % (op["path"], off + got))
            off, left = off + got, left - got
        self.writer.receipt(op["path"], start, total, digest)

    def _written(self):
        """All data operations so far are on disk (before an operation that reads or seals them)."""
        if self.writer is not None:
            self.writer.sync()

    def sums(self, op):
        files = [image_rel(rel) for rel in op["files"]]
        self._reply({"sums": image.checksum_files(self.dest, files)})

    def fix(self, op):
        fixed = read_json(image.FIXED, dir_fd=self.state_fd) or {}
        for rel, size in op["files"]:
            fd = self._file(rel)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            fixed[rel] = image.file_identity(os.fstat(fd))
        atomic_write(image.FIXED, fixed, dir_fd=self.state_fd)

    def deliver(self, op):
        data = self._read(int(op["len"]), "the manifest")
        manifest = image.parse_manifest(data.decode("utf-8", "replace"), "the manifest sent to %s" % self.dest)
        if self.journal is None:
            if manifest.get("id") != self.config.get("image_id"):
                raise Refused("the manifest is of image %s, not %s" % (manifest.get("id"), self.config.get("image_id")))
            self._write_manifest(data)
            self._reply({"delivered": True})
            return
        nonce = (manifest.get("migration") or {}).get("nonce")
        if nonce != self.config.get("nonce"):
            raise Refused("the manifest is not of this migration's checkpoint (nonce differs)")
        with self.journal.hold(wait=60, purpose="a transfer's delivery"):
            doc = self.journal.read() or {}
            if doc.get("phase") not in RECEIVE_PHASES or doc.get("nonce") != nonce:
                raise Refused("migration %s is no longer receiving on this host (phase %s): it was rolled back"
                              % (self.journal.id, doc.get("phase")))
            if identity(os.fstat(self.dir_fd)) != list(doc.get("image_dir_identity") or []) or \
                    not os.path.samestat(os.fstat(self.dir_fd), os.lstat(self.dest)):
                raise Refused("%s is no longer the directory migration %s created" % (self.dest, self.journal.id))
            atomic_write(image.MANIFEST, data, dir_fd=self.dir_fd)
            self.journal.transition("received", manifest_id=manifest.get("id"))
        self._reply({"delivered": True})

    def _write_manifest(self, data):
        """The manifest of an image outside a migration; into a replica store only while the push is still taken
        (under the job's lock, so that no failover comes between the check and the write)."""
        r = self.config.get("replica")
        if not r:
            atomic_write(image.MANIFEST, data, dir_fd=self.dir_fd)
            return
        try:
            with replica.push_guard(r["root"], r["job"], r["epoch"], r["node"]):
                self._refuse_committed()
                atomic_write(image.MANIFEST, data, dir_fd=self.dir_fd)
        except (GpuCkptError, Refused) as exc:
            self._reply(_refusal(exc))
            raise Refused(str(exc))

    def replica_op(self):
        """Run the replica store's operation of the config, reply, and wait for the end mark."""
        try:
            reply = dict(replica_images.run_op(self.config), ready=True)
        except (GpuCkptError, UnsafePath, OSError, KeyError, TypeError, ValueError) as exc:
            self._reply(_refusal(exc))
            return REFUSED
        self._reply(reply)
        line = self.inp.readline()
        if not line or json.loads(line).get("op") != "end":
            raise StreamCut("the stream ended before its end mark")
        return 0

    def remove_probe(self):
        """Remove the probe's scratch image at dest (remove_probe_dir), reply, and wait for the end mark."""
        try:
            removed = remove_probe_dir(self.dest, self.config.get("image_id"))
        except (Refused, UnsafePath, OSError) as exc:
            self._reply({"ready": False, "error": str(exc)})
            return REFUSED
        self._reply({"ready": True, "removed": removed})
        line = self.inp.readline()
        if not line or json.loads(line).get("op") != "end":
            raise StreamCut("the stream ended before its end mark")
        return 0

    def run(self):
        if self.config.get("remove_probe"):
            return self.remove_probe()
        if self.config.get("replica_op"):
            return self.replica_op()
        try:
            self.open()
        except (Refused, UnsafePath, OSError, GpuCkptError) as exc:
            self._reply(_refusal(exc))
            return REFUSED
        self._reply({"ready": True, "pid": os.getpid()})
        widen_pipe(self.inp)
        while True:
            line = self.inp.readline()
            if not line:
                raise StreamCut("the stream ended before its end mark")
            op = json.loads(line)
            kind = op.get("op")
            if kind == "end":
                break
            if kind not in ("data", "sums", "fix", "deliver"):
                raise Refused("unknown operation %r" % kind)
            if kind != "data":
                self._written()
            getattr(self, kind)(op)
        self._written()
        self.close()
        return 0

    def close(self):
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
        for fd in list(self.fds.values()) + [self.receipt_fd, self.state_fd, self.dir_fd]:
            if fd is not None:
                os.close(fd)
        self.fds = {}
        self.receipt_fd = self.state_fd = self.dir_fd = None


def widen_pipe(stream):
    """Give the stream's pipe PIPE_SIZE bytes where it is a pipe and the kernel allows it; else leave it."""
    try:
        fd = stream.fileno()
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both of the last two)
        pass


def _refusal(exc):
    """The reply of a receiver that refused; ``fenced`` when a replica store refused a fenced copy (StaleEpoch)."""
    reply = {"ready": False, "error": str(exc)}
    if getattr(exc, "fenced", False):
        reply["fenced"] = True
    return reply


def check_probe_dir(path):
    """Refuse a probe's directory that is not named as one (PROBE_PREFIX and something after it)."""
    name = os.path.basename(os.path.normpath(path))
    if not name.startswith(PROBE_PREFIX) or len(name) == len(PROBE_PREFIX):
        raise Refused("%s is not named as a probe's scratch image (%s...)" % (path, PROBE_PREFIX))


def remove_probe_dir(path, image_id):
    """Remove the scratch image of probe ``image_id`` at ``path``: only a directory (never a symlink) named
    as a probe's, ours, whose mark says a receiver created it for that probe. Returns False when it is not
    there (the probe never reached this host). Raises Refused when something else stands there."""
    check_probe_dir(path)
    try:
        dir_fd = open_dir(path)
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(dir_fd)
        mark = read_json(os.path.join(image.STATE_DIR, TRANSFER_MARK), dir_fd=dir_fd) or {}
    finally:
        os.close(dir_fd)
    if not image_id or st.st_uid != os.geteuid() or not mark.get("probe") or mark.get("image_id") != image_id:
        raise Refused("%s is not the scratch image of probe %s; leaving it as it is" % (path, image_id))
    for attempt in range(3):
        try:
            return remove_tree(path, identity(st))
        except OSError:
            if attempt == 2:
                raise
            time.sleep(1)  # a receiver of the probe cut a moment ago may still be creating a file there
    return False


def image_rel(rel):
    """The one check of every relative path a sender names (data, fix, sums): ``rel`` normalised (os.path.normpath:
    no ``./``, no doubled ``/``), refused (Refused) when it is not a non-empty string, is absolute, has a ``..``
    component or a NUL, or, once normalised, is nothing (``.``), falls into the image's state dir (its receipts,
    replica.json: what only this receiver and the replica store write) or names the manifest or one of its temporary
    files (only ``deliver`` writes the manifest, last). Every guard runs on what it returns, never on ``rel``."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/") or ".." in rel.split("/"):
        raise Refused("refusing path %r: an image's file is named by a relative path without '..'" % (rel,))
    norm = os.path.normpath(rel)
    parts = norm.split("/")
    if norm in (".", "") or parts[0] in (".", "..") or parts[0] == image.STATE_DIR or \
            (len(parts) == 1 and parts[0].startswith(image.MANIFEST)):
        raise Refused("refusing path %r: it is not one of the image's files (%s and the manifest are the "
                      "receiver's)" % (rel, image.STATE_DIR))
    return norm


def main(argv=None):
    argv = sys.argv if argv is None else argv
    config = json.loads(argv[1])
    receiver = Receiver(config, sys.stdin.buffer, sys.stdout.buffer)
    try:
        return receiver.run()
    except (Refused, UnsafePath) as exc:
        sys.stderr.write("gpuckpt receiver: %s\n" % exc)
        return REFUSED
    except Exception as exc:  # noqa: BLE001 - the sender reads this from the stream's stderr
        sys.stderr.write("gpuckpt receiver: %s\n" % exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
