"""Image directory, manifest and checksums."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import chunk_hasher
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import ImageError, InvalidTarget


def _make(tmp_path, size=3 * 2**20):
    d = tmp_path / "img"
    assert image.prepare_dir(str(d))["created"] is True
    (d / "pages-1.img").write_bytes(os.urandom(size))
    (d / "core-1.img").write_bytes(b"core")
    os.makedirs(d / "sub")
    (d / "sub" / "x.img").write_bytes(b"")
    files = image.checksum_files(str(d))
    image.write_manifest(str(d), {"files": files, "target": {"root_pid": 1}})
    return d


def test_round_trip_and_mode(tmp_path):
    d = _make(tmp_path)
    assert os.stat(d).st_mode & 0o777 == 0o700
    m = image.load_manifest(str(d))
    assert m["schema_version"] == image.SCHEMA_VERSION
    assert set(m["files"]) == {"pages-1.img", "core-1.img", os.path.join("sub", "x.img")}
    image.verify(str(d))
    # Our own state dir (logs, restore marker) is not part of the image.
    image.write_restored_mark(str(d), {"pids": [1]})
    image.verify(str(d))


def test_one_changed_byte_is_found_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "CHUNK", 2**20)
    d = _make(tmp_path)
    with open(d / "pages-1.img", "r+b") as fh:
        fh.seek(2 * 2**20 + 5)
        b = fh.read(1)
        fh.seek(2 * 2**20 + 5)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ImageError) as exc:
        image.verify(str(d))
    assert "pages-1.img" in str(exc.value) and "bytes 2097152-" in str(exc.value)


def test_extra_missing_and_truncated_files(tmp_path):
    d = _make(tmp_path)
    (d / "intruder.img").write_bytes(b"x")
    with pytest.raises(ImageError, match="intruder.img"):
        image.verify(str(d))
    os.unlink(d / "intruder.img")
    os.unlink(d / "core-1.img")
    with pytest.raises(ImageError, match="missing core-1.img"):
        image.verify(str(d))
    (d / "core-1.img").write_bytes(b"cor")
    with pytest.raises(ImageError, match="has 3 bytes"):
        image.verify(str(d))


def test_signature(tmp_path):
    d = _make(tmp_path)
    m = image.load_manifest(str(d))
    image.write_manifest(str(d), m, sign_key="s3cret")
    image.verify(str(d), sign_key="s3cret")
    with pytest.raises(ImageError, match="signature"):
        image.verify(str(d), sign_key="other")


def test_prepare_refuses_non_empty_and_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    with pytest.raises(InvalidTarget, match="not empty"):
        image.prepare_dir(str(tmp_path / "d"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidTarget, match="not a directory"):
        image.prepare_dir(str(tmp_path / "file"))
    (tmp_path / "e").mkdir()
    assert image.prepare_dir(str(tmp_path / "e"))["created"] is False
    (tmp_path / "l").symlink_to(tmp_path / "e")
    with pytest.raises(InvalidTarget, match="a symlink"):
        image.prepare_dir(str(tmp_path / "l"))
    # A parent that other users can write (and is not sticky) could have the image swapped under us.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(InvalidTarget, match="writable by other users"):
        image.prepare_dir(str(shared / "img"))
    assert not (shared / "img").exists()


def test_no_reader_follows_a_symlink_in_an_image(tmp_path):
    d = _make(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    os.unlink(d / "core-1.img")
    (d / "core-1.img").symlink_to(victim)
    with pytest.raises(ImageError, match="core-1.img.*a symlink"):
        image.verify(str(d))
    with pytest.raises(ImageError, match="a symlink"):
        image.checksum_files(str(d))
    os.unlink(d / "core-1.img")
    os.mkfifo(d / "core-1.img")
    with pytest.raises(ImageError, match="a special file"):
        image.verify(str(d))
    # Our state dir planted as a symlink is refused, not written through.
    os.unlink(d / "core-1.img")
    (d / ".gpuckpt").rename(tmp_path / "moved") if (d / ".gpuckpt").exists() else None
    (d / ".gpuckpt").symlink_to(tmp_path)
    with pytest.raises(ImageError, match="not a directory"):
        image.state_dir(str(d))
    with pytest.raises(Exception):
        image.write_restored_mark(str(d), {"pids": [1]})
    assert not (tmp_path / "restored.json").exists()


def test_a_changed_byte_with_its_mtime_put_back_is_found_despite_receipts(tmp_path, monkeypatch):
    """Receipts (the hashes a transfer's receiver took of what it wrote) stand for a file only while its
    identity, ctime included, is the one recorded when the transfer finished it."""
    monkeypatch.setattr(image, "CHUNK", 2**20)
    d = _make(tmp_path)
    m = image.load_manifest(str(d))
    state = image.state_dir(str(d))
    with open(os.path.join(state, "receipt-1.jsonl"), "w") as fh:
        for rel, meta in m["files"].items():
            for i, h in enumerate(meta["sha256_chunks"]):
                fh.write(json.dumps({"path": rel, "off": i * 2**20, "len": min(2**20, meta["size"] - i * 2**20),
                                     "sha256": h}) + "\n")
    fixed = {rel: image.file_identity(os.lstat(d / rel)) for rel in m["files"]}
    with open(os.path.join(state, "fixed.json"), "w") as fh:
        json.dump(fixed, fh)
    assert set(image.receipts(str(d), m["files"])) == set(m["files"])
    st = os.stat(d / "pages-1.img")
    with open(d / "pages-1.img", "r+b") as fh:
        fh.seek(5)
        b = fh.read(1)
        fh.seek(5)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(d / "pages-1.img", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "pages-1.img" not in image.receipts(str(d), m["files"])
    with pytest.raises(ImageError, match="checksum mismatch in pages-1.img"):
        image.verify(str(d))


def test_a_verification_without_receipts_reads_every_file_again(tmp_path, monkeypatch):
    """Image.verify(use_receipts=False) (a replica's full check): receipts that claim the manifest's checksums for a
    file that holds other bytes (a receipt proves what was written then, not what the disk holds now) are not taken."""
    monkeypatch.setattr(image, "CHUNK", 2**20)
    d = _make(tmp_path)
    m = image.load_manifest(str(d))
    with open(d / "pages-1.img", "r+b") as fh:  # the disk's bytes change before the receipts are written
        fh.write(b"\0" * 16)
    state = image.state_dir(str(d))
    with open(os.path.join(state, "receipt-1.jsonl"), "w") as fh:
        for rel, meta in m["files"].items():
            for i, h in enumerate(meta["sha256_chunks"]):
                fh.write(json.dumps({"path": rel, "off": i * 2**20, "len": min(2**20, meta["size"] - i * 2**20),
                                     "sha256": h}) + "\n")
    with open(os.path.join(state, "fixed.json"), "w") as fh:
        json.dump({rel: image.file_identity(os.lstat(d / rel)) for rel in m["files"]}, fh)
    with image.Image.open(str(d)) as img:
        img.verify()  # the receipts stand for the files
        with pytest.raises(ImageError, match="checksum mismatch in pages-1.img"):
            img.verify(use_receipts=False)


def test_missing_and_bad_manifest(tmp_path):
    with pytest.raises(ImageError, match="does not exist"):
        image.load_manifest(str(tmp_path / "nope"))
    (tmp_path / "m").mkdir()
    with pytest.raises(ImageError, match="has no manifest.json"):
        image.load_manifest(str(tmp_path / "m"))
    (tmp_path / "m" / "manifest.json").write_text("{")
    with pytest.raises(ImageError, match="not valid JSON"):
        image.load_manifest(str(tmp_path / "m"))
    (tmp_path / "m" / "manifest.json").write_text('{"schema_version": 99}')
    with pytest.raises(ImageError, match="schema 99"):
        image.load_manifest(str(tmp_path / "m"))


def _wait_for(cond, timeout=10.0):
    import time
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_chunks_hashed_while_the_dump_writes_match_a_hash_of_the_final_files(tmp_path, monkeypatch):
    """The checksums taken while the page files grow are the checksums of the finished image, and
    the whole chunks written during the dump are not hashed again at the end."""
    monkeypatch.setattr(image, "CHUNK", 2**16)
    d = tmp_path / "img"
    image.prepare_dir(str(d))
    hasher = chunk_hasher.ChunkHasher(str(d), workers=2, poll=0.005).follow()
    try:
        with open(d / "pages-1.img", "wb") as fh:
            for unused in range(8):  # appended in odd sizes, as a dump writes
                fh.write(os.urandom(40000))
                fh.flush()
            _wait_for(lambda: hasher.hashed_early() >= 4 * 2**16)
            fh.write(os.urandom(12345))
        (d / "core-1.img").write_bytes(b"core")
        (d / "pages-2.img").write_bytes(b"")
        final = hasher.checksums()
    finally:
        hasher.stop()
    assert final == image.checksum_files(str(d))
    assert hasher.hashed_early() >= 4 * 2**16
    assert len(final["pages-1.img"]["sha256_chunks"]) == -(-(8 * 40000 + 12345) // 2**16)


def test_a_page_file_replaced_during_the_dump_is_hashed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "CHUNK", 2**16)
    d = tmp_path / "img"
    image.prepare_dir(str(d))
    hasher = chunk_hasher.ChunkHasher(str(d), workers=1, poll=0.005).follow()
    try:
        (d / "pages-1.img").write_bytes(os.urandom(3 * 2**16))
        _wait_for(lambda: hasher.hashed_early() >= 3 * 2**16)
        os.unlink(d / "pages-1.img")  # a new inode, other bytes: the early digests must not be used
        (d / "pages-1.img").write_bytes(os.urandom(3 * 2**16))
        final = hasher.checksums()
    finally:
        hasher.stop()
    assert final == image.checksum_files(str(d))


def test_a_hasher_stopped_on_a_failed_dump_leaves_nothing_open(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "CHUNK", 2**16)
    d = tmp_path / "img"
    made = image.prepare_dir(str(d))
    before = len(os.listdir("/proc/self/fd"))
    hasher = chunk_hasher.ChunkHasher(str(d), workers=1, poll=0.005).follow()
    (d / "pages-1.img").write_bytes(os.urandom(4 * 2**16))
    _wait_for(lambda: hasher.hashed_early() > 0)
    hasher.stop()
    hasher.stop()
    image.discard(str(d), made)
    assert not d.exists()
    assert len(os.listdir("/proc/self/fd")) == before
