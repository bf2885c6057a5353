"""Image directory, manifest and checksums."""
from __future__ import annotations

import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.errors import ImageError, InvalidTarget


def _make(tmp_path, size=3 * 2**20):
    d = tmp_path / "img"
    assert image.prepare_dir(str(d)) is True
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
    assert image.prepare_dir(str(tmp_path / "e")) is False


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
