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

An image that exists is read through ``Image``, opened once (``with Image.open(path) as img``): the
directory's fd, taken without following a symlink, through which every later check and read goes; its
manifest, read once on first use; its state dir and restored mark. A restore hands that value around,
not its path. The functions of a path are for the checkpoint writing a new image, and for callers that
need one thing of an image (the transfer, a module's choice of runtime).

``_walk`` is the one walker of an image: every reader (checksums, verification, the transfer) takes
the image's files from it, and it refuses what a restore must never read through: a symlink, a device,
a fifo. Files are opened with O_NOFOLLOW, below the image's directory fd.

Plain Python with the standard library only: the receiving end of a transfer carries it too.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor

from .errors import ImageError, InvalidTarget
from .fsutil import (UnsafePath, atomic_write, create_private_dir, identity, open_beneath, open_dir, read_json, remove_tree, same_dir)
from .image_signature import check_signature, signature_of
from .procfs import usable_cpus

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = ".gpuckpt"
RESTORED_MARK = "restored.json"
FIXED = "fixed.json"          # the identity of each file as a transfer left it (see receipts())
RECEIPT_PREFIX = "receipt-"   # <STATE_DIR>/receipt-*.jsonl: the hash of each range a receiver wrote
CHUNK = 64 * 2**20
GROWING = re.compile(r"^pages-\d+\.img\Z")  # CRIU appends page data to these while it dumps, never rewrites


def state_dir(image_dir):
    """The image's own state dir (created 0700); a symlink there is refused."""
    with Image.open(image_dir) as img:
        return img.state_dir


def has_manifest(image_dir):
    try:
        return stat.S_ISREG(os.lstat(os.path.join(image_dir, MANIFEST)).st_mode)
    except OSError:
        return False


def _walk(dir_fd, where):
    """{relpath: lstat} of the image's files: every regular file below the directory ``dir_fd`` (named
    ``where`` in errors) except the manifest, its temporary files and our state dir. Raises ImageError
    on anything else (a symlink, a fifo, a device): no reader of an image follows one."""
    out = {}
    for root, dirs, files, root_fd in os.fwalk(".", dir_fd=dir_fd):
        rel_root = os.path.normpath(root)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in list(dirs) + files:
            rel = os.path.normpath(os.path.join(rel_root, name))
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                continue
            if rel_root == "." and (name == MANIFEST or (name.startswith(".") and name.endswith(".tmp"))):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise ImageError("%s in image %s is not a regular file (%s); refusing to read through it"
                                 % (rel, where, "a symlink" if stat.S_ISLNK(st.st_mode) else "a special file"),
                                 stage="verify", details={"bad_files": [rel]})
            out[rel] = st
    return out


def walk(image_dir):
    """The files of the image at ``image_dir`` (see _walk); none while it does not exist."""
    try:
        dir_fd = open_dir(image_dir)
    except FileNotFoundError:
        return {}
    try:
        return _walk(dir_fd, image_dir)
    finally:
        os.close(dir_fd)


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
    return min(16, usable_cpus())


def checksum_files(image_dir, files=None, known=None):
    """The checksums of the image at ``image_dir`` (see _checksums)."""
    dir_fd = open_dir(image_dir)
    try:
        return _checksums(dir_fd, image_dir, files, known)
    finally:
        os.close(dir_fd)


def _checksums(dir_fd, where, files=None, known=None):
    """{relpath: {"size": n, "sha256_chunks": [...]}} of the image in the directory ``dir_fd`` (named
    ``where`` in errors), computed on all cores, each file opened without following a symlink; a file
    of ``files`` (default: all of them) that is absent maps to None. ``known``: {(rel, chunk index,
    (st_dev, st_ino)): (length, digest)} already taken of chunks (ChunkHasher), each used for a file that
    is still that inode and whose chunk is still that long (a file's last chunk only once it is final)."""
    known = known or {}
    files = sorted(_walk(dir_fd, where)) if files is None else list(files)
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
                raise ImageError("%s in image %s is not a regular file" % (rel, where), stage="verify",
                                 details={"bad_files": [rel]})
            fds[rel] = fd
            size = st.st_size
            out[rel] = {"size": st.st_size, "sha256_chunks": [None] * len(range(0, max(size, 1), CHUNK))}
            for i, off in enumerate(range(0, max(size, 1), CHUNK)):
                length = max(0, min(CHUNK, size - off)) if size else 0
                taken = known.get((rel, i, (st.st_dev, st.st_ino)))
                if taken is not None and taken[0] == length:
                    out[rel]["sha256_chunks"][i] = taken[1]
                else:
                    jobs.append((rel, i, off, length))
        with ThreadPoolExecutor(_workers()) as pool:
            digests = list(pool.map(lambda j: _hash_range(fds[j[0]], j[2], j[3]), jobs))
        for (rel, i, _off, _len), d in zip(jobs, digests):
            out[rel]["sha256_chunks"][i] = d
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def write_manifest(image_dir, manifest, sign_key=None):
    manifest = dict(manifest)
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["chunk_size"] = CHUNK
    if sign_key:
        manifest["signature"] = {"alg": "hmac-sha256", "value": signature_of(manifest, sign_key)}
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
    """The manifest alone, for a caller that needs nothing else of the image (a transfer's source, a
    module's choice of runtime). Unlike Image.open, ``image_dir`` may itself be a symlink to the image."""
    try:
        dir_fd = os.open(image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise ImageError("image_dir %s does not exist" % image_dir, stage="verify")
    with Image(image_dir, dir_fd) as img:
        return img.manifest


class Image(object):
    """An image that exists, opened once to be checked, read and restored from:
    ``with Image.open(path) as img``.

    Every check and read goes through the directory's fd (``fd``, opened without following a
    symlink), so all of them are of the directory that was opened, whatever is renamed over its path
    since. The manifest is read on first use, once; the state dir is made on first use, once.
    ``path`` names the image where a path is needed (a runtime's restore, messages)."""

    def __init__(self, path, dir_fd, manifest=None):
        self.path, self.fd = path, dir_fd
        self.identity = identity(os.fstat(dir_fd))
        self._manifest = manifest
        self._state_fd = None

    @classmethod
    def open(cls, path, manifest=None):
        """Open the image directory ``path``; refused when a symlink or a file stands there.
        ``manifest``: the manifest the caller already read of it (not read again)."""
        path = os.path.abspath(path)
        try:
            dir_fd = open_dir(path)
        except FileNotFoundError:
            raise ImageError("image_dir %s does not exist" % path, stage="verify")
        except (UnsafePath, OSError) as exc:
            raise ImageError("cannot open image_dir %s: %s" % (path, exc), stage="verify",
                             hint="give the image's directory itself, not a symlink to it")
        return cls(path, dir_fd, manifest)

    def close(self):
        for fd in (self._state_fd, self.fd):
            if fd is not None:
                os.close(fd)
        self._state_fd = self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def has_identity(self, ident):
        """True when this is the directory of identity ``ident`` (fsutil.identity, recorded when it was created)."""
        return ident is not None and self.identity == list(ident)

    def has_manifest(self):
        try:
            return stat.S_ISREG(os.stat(MANIFEST, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    @property
    def manifest(self):
        if self._manifest is None:
            self._manifest = self._read_manifest()
        return self._manifest

    def _read_manifest(self):
        where = os.path.join(self.path, MANIFEST)
        if not self.has_manifest():
            raise ImageError("%s has no %s: not a gpuckpt image, or the checkpoint did not complete"
                             % (self.path, MANIFEST), stage="verify")
        try:
            fd = open_beneath(self.fd, MANIFEST)
        except (OSError, UnsafePath) as exc:
            raise ImageError("cannot read %s: %s" % (where, exc), stage="verify")
        with os.fdopen(fd, "rb") as fh:
            return parse_manifest(fh.read().decode("utf-8", "replace"), where)

    def files(self):
        """{relpath: lstat} of the image's files (see _walk)."""
        return _walk(self.fd, self.path)

    def checksums(self, files=None):
        return _checksums(self.fd, self.path, files)

    @property
    def state_dir(self):
        """The path of the image's own state dir, made (0700) on first use; a symlink there is refused."""
        self._open_state_dir()
        return os.path.join(self.path, STATE_DIR)

    def _open_state_dir(self):
        if self._state_fd is None:
            try:
                os.mkdir(STATE_DIR, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            try:
                self._state_fd = open_beneath(self.fd, STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
            except (UnsafePath, NotADirectoryError):
                raise ImageError("%s is not a directory (a symlink or a file stands there); refusing to use it"
                                 % os.path.join(self.path, STATE_DIR), stage="preflight")
        return self._state_fd

    def restored_mark(self):
        """What the last restore of this image outside a migration recorded (write_restored_mark), or None."""
        return read_json(os.path.join(STATE_DIR, RESTORED_MARK), dir_fd=self.fd)

    def write_restored_mark(self, data):
        atomic_write(RESTORED_MARK, data, dir_fd=self._open_state_dir())

    def verify(self, sign_key=None, allow_unverified_signature=False, files=None, use_receipts=True):
        """Check the manifest's signature (check_signature), the listing, then every file (``files``: only
        these) against the manifest. Raises ImageError naming the file. Returns the checksums' seconds.
        ``use_receipts``: take the checksums that this host's receivers took as they wrote (receipts()) for the
        files they cover; never with a signature key (a signed image is read again in full)."""
        manifest = self.manifest
        check_signature(manifest, sign_key, allow_unverified_signature, self.path)
        expected = manifest.get("files") or {}
        self._check_listing(expected)
        expected = expected if files is None else {rel: expected[rel] for rel in files}
        start = time.monotonic()
        received = self.receipts(expected) if use_receipts and not sign_key else {}
        actual = self.checksums(sorted(set(expected) - set(received)))
        actual.update(received)
        for rel, meta in sorted(expected.items()):
            if rel in received and actual[rel]["sha256_chunks"] != meta["sha256_chunks"]:
                actual[rel] = self.checksums([rel])[rel]  # the verdict always comes from the file
            for i, (want, got) in enumerate(zip(meta["sha256_chunks"], actual[rel]["sha256_chunks"])):
                if want != got:
                    raise ImageError("checksum mismatch in %s of image %s (bytes %d-%d): the image is corrupt"
                                     % (rel, self.path, i * CHUNK, min((i + 1) * CHUNK, meta["size"]) - 1),
                                     stage="verify", details={"bad_files": [rel], "bad_chunks": {rel: [i]}},
                                     hint="re-transfer or re-take the checkpoint; nothing was restored")
        return time.monotonic() - start

    def _check_listing(self, expected):
        """The image holds exactly the files the manifest lists, each of its size."""
        present = self.files()
        missing = sorted(set(expected) - set(present))
        if missing:
            raise ImageError("image %s is missing %s" % (self.path, ", ".join(missing[:5])), stage="verify",
                             details={"bad_files": missing})
        extra = sorted(set(present) - set(expected))
        if extra:
            raise ImageError("image %s holds files the manifest does not list: %s" % (self.path, ", ".join(extra[:5])),
                             stage="verify", details={"bad_files": extra})
        for rel, meta in expected.items():
            if present[rel].st_size != meta["size"]:
                raise ImageError("%s in image %s has %d bytes, the manifest says %d"
                                 % (rel, self.path, present[rel].st_size, meta["size"]),
                                 stage="verify", details={"bad_files": [rel]})

    def receipts(self, expected):
        """{relpath: {"size", "sha256_chunks"}} from a transfer's receipts (transfer receivers hash every
        range they write, on this host), for the files that the receipts cover chunk by chunk and whose
        identity (file_identity) is still the one the transfer recorded when it finished them. Those
        files need not be read again; any other file is hashed from disk. Not used with a sign_key: a
        signed image is read in full."""
        try:
            state_fd = open_beneath(self.fd, STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
        except (OSError, UnsafePath):
            return {}
        try:
            fixed = read_json(FIXED, dir_fd=state_fd) or {}
            ranges = _receipt_ranges(state_fd)
        except (OSError, UnsafePath):
            return {}
        finally:
            os.close(state_fd)
        out = {}
        for rel, meta in expected.items():
            try:
                now = file_identity(os.stat(rel, dir_fd=self.fd, follow_symlinks=False))
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


def _receipt_ranges(state_fd):
    """{relpath: {offset: (length, sha256)}} of every receipt in the state dir ``state_fd``; a range
    that two receipts disagree on maps to None (not trusted)."""
    ranges = {}
    for name in os.listdir(state_fd):
        if not (name.startswith(RECEIPT_PREFIX) and name.endswith(".jsonl")):
            continue
        with os.fdopen(open_beneath(state_fd, name), "rb") as fh:
            for line in fh:
                try:
                    r = json.loads(line)
                    seen = ranges.setdefault(r["path"], {})
                    got = (r["len"], r["sha256"])
                    seen[r["off"]] = got if seen.get(r["off"], got) == got else None  # disagreeing: no trust
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line of a receiver that was killed
    return ranges


def verify(image_dir, manifest=None, sign_key=None, allow_unverified_signature=False):
    """Image.verify of the image at ``image_dir``; ``manifest``: its manifest when already read."""
    with Image.open(image_dir, manifest) as img:
        return img.verify(sign_key, allow_unverified_signature)


def file_identity(st):
    """What a receipt is checked against: any write, truncate or utime changes the ctime, which no
    user-space call can set back (a changed byte with its mtime put back shows here)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def receipts(image_dir, expected):
    """Image.receipts of the image at ``image_dir``."""
    with Image.open(image_dir) as img:
        return img.receipts(expected)


def image_bytes(manifest):
    return sum(m["size"] for m in (manifest.get("files") or {}).values())


def write_restored_mark(image_dir, data):
    with Image.open(image_dir) as img:
        img.write_restored_mark(data)
