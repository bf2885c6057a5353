# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The image: one 0700 directory per checkpoint.

  <image>/manifest.json   written last (its presence means the image is complete): schema version,
                          host facts, runtime, processes, sizes, stage timings, and per-file checksums
  <image>/...             the runtime's files (CRIU's *.img, ...)
  <image>/.gpuckpt/       logs and the restore marker: ours, not part of the image, not checksummed

Checksums are SHA-256 per 64 MiB chunk, so a 50 GB image hashes on all cores in parallel and a
transfer can later be verified (and resumed) chunk by chunk; verification names the file and offset.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from .errors import ImageError, InvalidTarget

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = ".gpuckpt"
RESTORED_MARK = "restored.json"
CHUNK = 64 * 2**20


def state_dir(image_dir):
    path = os.path.join(image_dir, STATE_DIR)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def has_manifest(image_dir):
    return os.path.isfile(os.path.join(image_dir, MANIFEST))


def list_files(image_dir):
    """Relative paths of the image's files (not the manifest, not our state dir)."""
    out = []
    for root, dirs, files in os.walk(image_dir):
        rel_root = os.path.relpath(root, image_dir)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for f in files:
            rel = os.path.normpath(os.path.join(rel_root, f))
            if rel != MANIFEST and not rel.startswith(MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def prepare_dir(image_dir):
    """Create the image dir (0700) or accept an existing empty one. Returns True when created.

    Raises InvalidTarget, touching nothing, when the dir holds anything.
    """
    if os.path.lexists(image_dir) and not os.path.isdir(image_dir):
        raise InvalidTarget("image_dir %s exists and is not a directory" % image_dir, stage="preflight")
    if os.path.isdir(image_dir):
        entries = os.listdir(image_dir)
        if entries:
            raise InvalidTarget("image_dir %s is not empty (%s); refusing to mix a new image with other files"
                                % (image_dir, ", ".join(sorted(entries)[:5])), stage="preflight",
                                hint="give a new or empty directory")
        os.chmod(image_dir, 0o700)
        return False
    parent = os.path.dirname(os.path.abspath(image_dir))
    os.makedirs(parent, exist_ok=True)
    os.mkdir(image_dir, 0o700)
    return True


def discard(image_dir, created):
    """Remove a partial image: the whole dir when we created it, else only its content."""
    if created:
        shutil.rmtree(image_dir, ignore_errors=True)
        return
    for entry in os.listdir(image_dir):
        p = os.path.join(image_dir, entry)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.unlink(p)


def _hash_chunk(path, offset, length):
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, end = offset, offset + length
        while pos < end:
            buf = os.pread(fd, min(8 * 2**20, end - pos), pos)
            if not buf:
                break
            h.update(buf)
            pos += len(buf)
    finally:
        os.close(fd)
    return h.hexdigest()


def _workers():
    return max(1, min(16, os.cpu_count() or 1))


def checksum_files(image_dir, files=None):
    """{relpath: {"size": n, "sha256_chunks": [...]}} computed on all cores."""
    files = list_files(image_dir) if files is None else files
    jobs = []
    sizes = {}
    for rel in files:
        size = os.path.getsize(os.path.join(image_dir, rel))
        sizes[rel] = size
        for off in range(0, max(size, 1), CHUNK):
            jobs.append((rel, off, min(CHUNK, size - off) if size else 0))
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(lambda j: _hash_chunk(os.path.join(image_dir, j[0]), j[1], j[2]), jobs))
    out = {rel: {"size": sizes[rel], "sha256_chunks": []} for rel in files}
    for (rel, _off, _len), d in zip(jobs, digests):
        out[rel]["sha256_chunks"].append(d)
    return out


def _signature(manifest, key):
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(key.encode() if isinstance(key, str) else key, body, hashlib.sha256).hexdigest()


def write_manifest(image_dir, manifest, sign_key=None):
    manifest = dict(manifest)
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["chunk_size"] = CHUNK
    if sign_key:
        manifest["signature"] = {"alg": "hmac-sha256", "value": _signature(manifest, sign_key)}
    path = os.path.join(image_dir, MANIFEST)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)
    return manifest


def load_manifest(image_dir):
    path = os.path.join(image_dir, MANIFEST)
    if not os.path.isdir(image_dir):
        raise ImageError("image_dir %s does not exist" % image_dir, stage="verify")
    if not os.path.isfile(path):
        raise ImageError("%s has no %s: not a gpuckpt image, or the checkpoint did not complete"
                         % (image_dir, MANIFEST), stage="verify")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except ValueError as exc:
        raise ImageError("%s is not valid JSON: %s" % (path, exc), stage="verify")
    if manifest.get("schema_version", 0) > SCHEMA_VERSION:
        raise ImageError("image %s has manifest schema %s; this collection reads up to %s"
                         % (image_dir, manifest.get("schema_version"), SCHEMA_VERSION), stage="verify",
                         hint="upgrade gpuckpt.fleet on this host")
    return manifest


def verify(image_dir, manifest=None, sign_key=None):
    """Check every file against the manifest before anything is touched. Raises ImageError naming the file."""
    manifest = manifest or load_manifest(image_dir)
    if sign_key:
        sig = (manifest.get("signature") or {}).get("value")
        if not sig or not hmac.compare_digest(sig, _signature(manifest, sign_key)):
            raise ImageError("manifest signature of %s does not match the configured key" % image_dir,
                             stage="verify", hint="the image was altered or signed with another key")
    expected = manifest.get("files") or {}
    present = set(list_files(image_dir))
    missing = sorted(set(expected) - present)
    if missing:
        raise ImageError("image %s is missing %s" % (image_dir, ", ".join(missing[:5])), stage="verify",
                         details={"bad_files": missing})
    extra = sorted(present - set(expected))
    if extra:
        raise ImageError("image %s holds files the manifest does not list: %s" % (image_dir, ", ".join(extra[:5])),
                         stage="verify", details={"bad_files": extra})
    for rel, meta in expected.items():
        size = os.path.getsize(os.path.join(image_dir, rel))
        if size != meta["size"]:
            raise ImageError("%s in image %s has %d bytes, the manifest says %d" % (rel, image_dir, size, meta["size"]),
                             stage="verify", details={"bad_files": [rel]})
    start = time.monotonic()
    received = {} if sign_key else push_receipts(image_dir, expected)
    actual = checksum_files(image_dir, sorted(set(expected) - set(received)))
    actual.update(received)
    for rel, meta in sorted(expected.items()):
        if rel in received and actual[rel]["sha256_chunks"] != meta["sha256_chunks"]:
            # The verdict on a mismatch always comes from the file itself (a repair may have fixed it
            # since, keeping the mtime).
            actual[rel] = checksum_files(image_dir, [rel])[rel]
        for i, (want, got) in enumerate(zip(meta["sha256_chunks"], actual[rel]["sha256_chunks"])):
            if want != got:
                raise ImageError("checksum mismatch in %s of image %s (bytes %d-%d): the image is corrupt"
                                 % (rel, image_dir, i * CHUNK, min((i + 1) * CHUNK, meta["size"]) - 1),
                                 stage="verify", details={"bad_files": [rel]},
                                 hint="re-transfer or re-take the checkpoint; nothing was restored")
    return time.monotonic() - start


def push_receipts(image_dir, expected):
    """{relpath: {"sha256_chunks": [...]}} from a push's receipts (transfer.RECEIVER), for the files
    that the receipts cover chunk by chunk and that are unchanged since the push gave them their size
    and mtime. Those hashes were taken on this host, of the bytes written into these files, so the
    files need not be read again; any other file is hashed from disk. Not used with a sign_key: a
    signed image is read in full."""
    d = os.path.join(image_dir, STATE_DIR)
    try:
        with open(os.path.join(d, "push-fixed.json")) as fh:
            fixed = json.load(fh)
        ranges = {}
        for name in os.listdir(d):
            if name.startswith("push-receipt-") and name.endswith(".json"):
                with open(os.path.join(d, name)) as fh:
                    for rel, items in json.load(fh).items():
                        for off, length, digest in items:
                            ranges.setdefault(rel, {})[off] = (length, digest)
    except (OSError, ValueError):
        return {}
    out = {}
    for rel, meta in expected.items():
        try:
            st = os.stat(os.path.join(image_dir, rel))
        except OSError:
            continue
        if fixed.get(rel) != [st.st_size, st.st_mtime_ns] or st.st_size != meta["size"]:
            continue  # written again since the push (a repair, a copy by hand): read it
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
    try:
        with open(os.path.join(image_dir, STATE_DIR, RESTORED_MARK)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_restored_mark(image_dir, data):
    path = os.path.join(state_dir(image_dir), RESTORED_MARK)
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh)
    os.rename(path + ".tmp", path)
