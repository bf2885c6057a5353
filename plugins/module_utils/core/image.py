# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The image: one 0700 directory per checkpoint.

  <image>/manifest.json   written last (its presence means the image is complete): schema version,
                          host facts, runtime, processes, sizes, stage timings, per-file checksums
  <image>/...             the runtime's files (CRIU's *.img, ...): regular files only
  <image>/.gpuckpt/       logs, receipts of a transfer, the restore marker: ours, not part of the image

Checksums are SHA-256 per 64 MiB chunk, so a 50 GB image hashes on all cores in parallel, and a
transfer can be verified, resumed and repaired chunk by chunk; verification names the file and offset.

``walk`` is the one walker of an image: every reader (checksums, verification, the transfer) takes
the image's files from it, and it refuses what a restore must never read through: a symlink, a device,
a fifo. Files are opened with O_NOFOLLOW.

Plain Python with the standard library only: the receiving end of a transfer carries it too.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:  # a package import; the transfer's receiver program defines these names before this code
    from .errors import ImageError, InvalidTarget
    from .fsutil import (UnsafePath, atomic_write, create_private_dir, identity, open_beneath, open_dir, read_json, remove_tree, same_dir)
except ImportError:  # pragma: no cover - only in the receiver program
    pass

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = ".gpuckpt"
RESTORED_MARK = "restored.json"
FIXED = "fixed.json"          # the identity of each file as a transfer left it (see receipts())
RECEIPT_PREFIX = "receipt-"   # <STATE_DIR>/receipt-*.jsonl: the hash of each range a receiver wrote
CHUNK = 64 * 2**20
GROWING = re.compile(r"^pages-\d+\.img$")  # CRIU appends page data to these while it dumps, never rewrites


def state_dir(image_dir):
    """The image's own state dir (created 0700); a symlink there is refused."""
    path = os.path.join(image_dir, STATE_DIR)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ImageError("%s is not a directory (a symlink or a file stands there); refusing to use it" % path,
                             stage="preflight")
    return path


def has_manifest(image_dir):
    try:
        return stat.S_ISREG(os.lstat(os.path.join(image_dir, MANIFEST)).st_mode)
    except OSError:
        return False


def walk(image_dir):
    """{relpath: lstat} of the image's files: every regular file below ``image_dir`` except the
    manifest, its temporary files and our state dir. Raises ImageError on anything else (a symlink,
    a fifo, a device): no reader of an image follows one."""
    out = {}
    for root, dirs, files in os.walk(image_dir):
        rel_root = os.path.relpath(root, image_dir)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in list(dirs) + files:
            full = os.path.join(root, name)
            rel = os.path.normpath(os.path.join(rel_root, name))
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                continue
            if rel_root == "." and (name == MANIFEST or (name.startswith(".") and name.endswith(".tmp"))):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise ImageError("%s in image %s is not a regular file (%s); refusing to read through it"
                                 % (rel, image_dir, "a symlink" if stat.S_ISLNK(st.st_mode) else "a special file"),
                                 stage="verify", details={"bad_files": [rel]})
            out[rel] = st
    return out


def list_files(image_dir):
    """Relative paths of the image's files (see walk)."""
    return sorted(walk(image_dir))


def check_dir(image_dir):
    """Refuse, touching nothing, an image dir that is not new or an empty directory of ours.
    Returns its lstat, or None when it does not exist."""
    try:
        st = os.lstat(image_dir)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidTarget("image_dir %s exists and is not a directory (%s)"
                            % (image_dir, "a symlink" if stat.S_ISLNK(st.st_mode) else "a file"), stage="preflight")
    entries = os.listdir(image_dir)
    if entries:
        raise InvalidTarget("image_dir %s is not empty (%s); refusing to mix a new image with other files"
                            % (image_dir, ", ".join(sorted(entries)[:5])), stage="preflight",
                            hint="give a new or empty directory")
    if st.st_uid != os.geteuid():
        raise InvalidTarget("image_dir %s belongs to uid %d, not to us; another user could read or replace "
                            "the image" % (image_dir, st.st_uid), stage="preflight",
                            hint="give a new directory; it is created with mode 0700")
    return st


def prepare_dir(image_dir):
    """Create the image dir (0700, below safe parents) or take an existing empty one of ours.
    Returns {"created": bool, "identity": [dev, ino]}. Raises InvalidTarget, touching nothing, when
    it holds anything, is not a directory, or is not ours."""
    st = check_dir(image_dir)
    if st is not None:
        os.chmod(image_dir, 0o700)
        return {"created": False, "identity": identity(st)}
    try:
        return {"created": True, "identity": create_private_dir(image_dir)}
    except (UnsafePath, FileExistsError) as exc:
        raise InvalidTarget("cannot create image_dir %s: %s" % (image_dir, exc), stage="preflight",
                            hint="use a directory below root-owned parents that others cannot write")


def discard(image_dir, made):
    """Remove a partial image: the whole dir when we created it (``made`` from prepare_dir), else only
    its content."""
    if made.get("created"):
        remove_tree(image_dir, made.get("identity"))
        return
    if not same_dir(image_dir, made.get("identity")):
        return
    for entry in os.listdir(image_dir):
        p = os.path.join(image_dir, entry)
        if os.path.isdir(p) and not os.path.islink(p):
            remove_tree(p, identity(os.lstat(p)))
        else:
            os.unlink(p)


def _hash_range(fd, offset, length):
    h = hashlib.sha256()
    pos, end = offset, offset + length
    while pos < end:
        buf = os.pread(fd, min(8 * 2**20, end - pos), pos)
        if not buf:
            break
        h.update(buf)
        pos += len(buf)
    return h.hexdigest()


def _workers():
    return max(1, min(16, os.cpu_count() or 1))


def checksum_files(image_dir, files=None, known=None):
    """{relpath: {"size": n, "sha256_chunks": [...]}} computed on all cores, each file opened without
    following a symlink; a file of ``files`` that is absent maps to None. ``known``: {(rel, chunk
    index, (st_dev, st_ino)): digest} already taken of whole chunks (ChunkHasher), used for a file
    that is still that inode and still holds that whole chunk."""
    known = known or {}
    files = list_files(image_dir) if files is None else list(files)
    dir_fd = open_dir(image_dir)
    fds, jobs, out = {}, [], {}
    try:
        for rel in files:
            try:
                fd = open_beneath(dir_fd, rel)
            except FileNotFoundError:
                out[rel] = None
                continue
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise ImageError("%s in image %s is not a regular file" % (rel, image_dir), stage="verify",
                                 details={"bad_files": [rel]})
            fds[rel] = fd
            size = st.st_size
            out[rel] = {"size": st.st_size, "sha256_chunks": [None] * len(range(0, max(size, 1), CHUNK))}
            for i, off in enumerate(range(0, max(size, 1), CHUNK)):
                digest = known.get((rel, i, (st.st_dev, st.st_ino))) if off + CHUNK <= size else None
                if digest is not None:
                    out[rel]["sha256_chunks"][i] = digest
                else:
                    jobs.append((rel, i, off, max(0, min(CHUNK, size - off)) if size else 0))
        with ThreadPoolExecutor(_workers()) as pool:
            digests = list(pool.map(lambda j: _hash_range(fds[j[0]], j[2], j[3]), jobs))
        for (rel, i, _off, _len), d in zip(jobs, digests):
            out[rel]["sha256_chunks"][i] = d
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(dir_fd)
    return out


class ChunkHasher(object):
    """The manifest's checksums, taken while the runtime writes the image: each whole chunk of a
    growing page file is hashed as soon as it is written (CRIU only appends to them), so that once
    the dump ends only the last chunks and the small files are left to hash, not the whole image.

    ``follow()`` starts hashing; ``checksums()`` stops following and returns what checksum_files
    would. A chunk hashed early is used only if its file is still the same inode and at least as long;
    anything else is hashed again at the end. ``stop()`` (idempotent) ends it on any path."""

    def __init__(self, image_dir, workers=None, poll=0.05):
        self.image_dir = image_dir
        self.poll = poll
        # Fewer threads than cores: the dump and the push's ciphers run at the same time.
        self.pool = ThreadPoolExecutor(workers or max(1, min(8, (os.cpu_count() or 1) // 2)))
        self.early = {}        # (rel, chunk index) -> future of its digest
        self.inodes = {}       # rel -> (st_dev, st_ino) its early chunks were read from
        self.fds = {}
        self._stop = threading.Event()
        self._thread = None
        self._dir_fd = None

    def follow(self):
        self._dir_fd = open_dir(self.image_dir)
        self._thread = threading.Thread(target=self._loop, name="gpuckpt-hash-follow")
        self._thread.daemon = True
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.poll):
            try:
                for rel, st in walk(self.image_dir).items():
                    if GROWING.match(os.path.basename(rel)):
                        self._hash_whole_chunks(rel, st)
            except (OSError, ImageError, UnsafePath):
                pass  # a file went away (a failed dump is being discarded): checksums() decides

    def _hash_whole_chunks(self, rel, st):
        ident = (st.st_dev, st.st_ino)
        if self.inodes.setdefault(rel, ident) != ident:
            return  # replaced while we followed it: all of it is hashed at the end
        if rel not in self.fds:
            self.fds[rel] = open_beneath(self._dir_fd, rel)
        for i in range(st.st_size // CHUNK):
            if (rel, i) not in self.early:
                self.early[(rel, i)] = self.pool.submit(_hash_range, self.fds[rel], i * CHUNK, CHUNK)

    def _stop_following(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def checksums(self, files=None):
        self._stop_following()
        try:
            final = checksum_files(self.image_dir, files, known=self._known())
        finally:
            self.stop()
        return final

    def _known(self):
        known = {}
        for (rel, i), fut in self.early.items():
            try:
                known[(rel, i, self.inodes[rel])] = fut.result()
            except (OSError, ValueError):
                pass  # hashed again at the end
        return known

    def hashed_early(self):
        return sum(1 for f in self.early.values() if f.done() and not f.exception()) * CHUNK

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


def _signature(manifest, key):
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(key.encode() if isinstance(key, str) else key, body, hashlib.sha256).hexdigest()


def write_manifest(image_dir, manifest, sign_key=None):
    manifest = dict(manifest)
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["chunk_size"] = CHUNK
    if sign_key:
        manifest["signature"] = {"alg": "hmac-sha256", "value": _signature(manifest, sign_key)}
    atomic_write(os.path.join(image_dir, MANIFEST), manifest)
    return manifest


def parse_manifest(data, where):
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise ImageError("%s is not valid JSON: %s" % (where, exc), stage="verify")
    if not isinstance(manifest, dict):
        raise ImageError("%s is not a gpuckpt manifest" % where, stage="verify")
    if manifest.get("schema_version", 0) > SCHEMA_VERSION:
        raise ImageError("%s has manifest schema %s; this collection reads up to %s"
                         % (where, manifest.get("schema_version"), SCHEMA_VERSION), stage="verify",
                         hint="upgrade gpuckpt.fleet on this host")
    return manifest


def load_manifest(image_dir):
    path = os.path.join(image_dir, MANIFEST)
    if not os.path.isdir(image_dir):
        raise ImageError("image_dir %s does not exist" % image_dir, stage="verify")
    if not has_manifest(image_dir):
        raise ImageError("%s has no %s: not a gpuckpt image, or the checkpoint did not complete"
                         % (image_dir, MANIFEST), stage="verify")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError("cannot read %s: %s" % (path, exc), stage="verify")
    with os.fdopen(fd, "rb") as fh:
        return parse_manifest(fh.read().decode("utf-8", "replace"), path)


def verify(image_dir, manifest=None, sign_key=None):
    """Check every file against the manifest before anything is touched. Raises ImageError naming the
    file. Returns the seconds spent on the checksums."""
    manifest = manifest or load_manifest(image_dir)
    if sign_key:
        sig = (manifest.get("signature") or {}).get("value")
        if not sig or not hmac.compare_digest(sig, _signature(manifest, sign_key)):
            raise ImageError("manifest signature of %s does not match the configured key" % image_dir,
                             stage="verify", hint="the image was altered or signed with another key")
    expected = manifest.get("files") or {}
    present = walk(image_dir)
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ImageError("image %s is missing %s" % (image_dir, ", ".join(missing[:5])), stage="verify",
                         details={"bad_files": missing})
    extra = sorted(set(present) - set(expected))
    if extra:
        raise ImageError("image %s holds files the manifest does not list: %s" % (image_dir, ", ".join(extra[:5])),
                         stage="verify", details={"bad_files": extra})
    for rel, meta in expected.items():
        if present[rel].st_size != meta["size"]:
            raise ImageError("%s in image %s has %d bytes, the manifest says %d"
                             % (rel, image_dir, present[rel].st_size, meta["size"]),
                             stage="verify", details={"bad_files": [rel]})
    start = time.monotonic()
    received = {} if sign_key else receipts(image_dir, expected)
    actual = checksum_files(image_dir, sorted(set(expected) - set(received)))
    actual.update(received)
    for rel, meta in sorted(expected.items()):
        if rel in received and actual[rel]["sha256_chunks"] != meta["sha256_chunks"]:
            actual[rel] = checksum_files(image_dir, [rel])[rel]  # the verdict always comes from the file
        for i, (want, got) in enumerate(zip(meta["sha256_chunks"], actual[rel]["sha256_chunks"])):
            if want != got:
                raise ImageError("checksum mismatch in %s of image %s (bytes %d-%d): the image is corrupt"
                                 % (rel, image_dir, i * CHUNK, min((i + 1) * CHUNK, meta["size"]) - 1),
                                 stage="verify", details={"bad_files": [rel], "bad_chunks": {rel: [i]}},
                                 hint="re-transfer or re-take the checkpoint; nothing was restored")
    return time.monotonic() - start


def file_identity(st):
    """What a receipt is checked against: any write, truncate or utime changes the ctime, which no
    user-space call can set back (a changed byte with its mtime put back shows here)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def receipts(image_dir, expected):
    """{relpath: {"size", "sha256_chunks"}} from a transfer's receipts (transfer receivers hash every
    range they write, on this host), for the files that the receipts cover chunk by chunk and whose
    identity (file_identity) is still the one the transfer recorded when it finished them. Those
    files need not be read again; any other file is hashed from disk. Not used with a sign_key: a
    signed image is read in full."""
    state = os.path.join(image_dir, STATE_DIR)
    try:
        st = os.lstat(state)
        if not stat.S_ISDIR(st.st_mode):
            return {}
        fixed = read_json(os.path.join(state, FIXED)) or {}
        ranges = {}
        for name in os.listdir(state):
            if not (name.startswith(RECEIPT_PREFIX) and name.endswith(".jsonl")):
                continue
            fd = os.open(os.path.join(state, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                        seen = ranges.setdefault(r["path"], {})
                        got = (r["len"], r["sha256"])
                        seen[r["off"]] = got if seen.get(r["off"], got) == got else None  # disagreeing: no trust
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line of a receiver that was killed
    except OSError:
        return {}
    out = {}
    for rel, meta in expected.items():
        try:
            now = file_identity(os.lstat(os.path.join(image_dir, rel)))
        except OSError:
            continue
        if fixed.get(rel) != now or now[2] != meta["size"]:
            continue  # written since the transfer finished it (a repair, a copy by hand, a flipped byte)
        chunks, have = [], ranges.get(rel, {})
        for off in range(0, max(meta["size"], 1), CHUNK):
            got = have.get(off)
            if got is None or got[0] != min(CHUNK, meta["size"] - off):
                chunks = None
                break
            chunks.append(got[1])
        if chunks is not None:
            out[rel] = {"size": meta["size"], "sha256_chunks": chunks}
    return out


def image_bytes(manifest):
    return sum(m["size"] for m in (manifest.get("files") or {}).values())


def read_restored_mark(image_dir):
    return read_json(os.path.join(image_dir, STATE_DIR, RESTORED_MARK))


def write_restored_mark(image_dir, data):
    atomic_write(os.path.join(state_dir(image_dir), RESTORED_MARK), data)
