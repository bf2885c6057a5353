"""An image opened once (image.Image): every check and read goes through the directory it opened, its
manifest is read once, and what stands at its path instead (a symlink, a file, nothing) is refused
before anything is read."""
from __future__ import annotations

import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import ImageError


def _make(tmp_path, name="img", payload=b"pages"):
    d = tmp_path / name
    image.prepare_dir(str(d))
    (d / "pages-1.img").write_bytes(payload)
    os.makedirs(d / "sub")
    (d / "sub" / "x.img").write_bytes(b"x")
    image.write_manifest(str(d), {"id": name, "files": image.checksum_files(str(d)), "target": {"pids": [1]}})
    return d


def test_what_stands_at_the_path_instead_of_an_image_dir_is_refused(tmp_path):
    with pytest.raises(ImageError, match="does not exist"):
        image.Image.open(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ImageError, match="not a directory"):
        image.Image.open(str(tmp_path / "file"))
    d = _make(tmp_path)
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(ImageError, match="a symlink"):
        image.Image.open(str(tmp_path / "link"))
    # One thing of an image, read by its path, may still go through a symlink (gpu_image_sync's src).
    assert image.load_manifest(str(tmp_path / "link"))["id"] == "img"


def test_every_read_is_of_the_directory_that_was_opened(tmp_path):
    """A directory renamed over the image's path after it was opened is not what is verified or marked."""
    d = _make(tmp_path)
    with image.Image.open(str(d)) as img:
        os.rename(d, tmp_path / "moved")
        _make(tmp_path, payload=b"other pages")
        assert img.manifest["id"] == "img" and img.path == str(d)
        img.verify()
        assert set(img.files()) == {"pages-1.img", os.path.join("sub", "x.img")}
        img.write_restored_mark({"pids": [1]})
        assert img.restored_mark() == {"pids": [1]}
        assert img.has_identity(image.identity(os.lstat(tmp_path / "moved")))
        assert not img.has_identity(image.identity(os.lstat(d)))
    assert os.path.exists(tmp_path / "moved" / image.STATE_DIR / image.RESTORED_MARK)
    assert not os.path.exists(d / image.STATE_DIR / image.RESTORED_MARK)


def test_the_manifest_is_read_once(tmp_path, monkeypatch):
    d = _make(tmp_path)
    reads = []
    parse = image.parse_manifest
    monkeypatch.setattr(image, "parse_manifest", lambda data, where: reads.append(where) or parse(data, where))
    with image.Image.open(str(d)) as img:
        img.verify()
        img.verify()
        assert img.manifest["id"] == "img"
    assert len(reads) == 1


def test_a_missing_manifest_and_a_planted_state_dir_are_named(tmp_path):
    d = tmp_path / "img"
    image.prepare_dir(str(d))
    with image.Image.open(str(d)) as img:
        assert not img.has_manifest() and img.restored_mark() is None
        with pytest.raises(ImageError, match="has no manifest.json"):
            img.manifest
        (d / image.STATE_DIR).symlink_to(tmp_path)
        with pytest.raises(ImageError, match="not a directory"):
            img.state_dir
        with pytest.raises(ImageError, match="not a directory"):
            img.write_restored_mark({"pids": [1]})
    assert not (tmp_path / image.RESTORED_MARK).exists()


def test_an_image_closed_leaves_nothing_open(tmp_path):
    d = _make(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    with image.Image.open(str(d)) as img:
        img.verify()
        assert img.state_dir == os.path.join(str(d), image.STATE_DIR)
        img.write_restored_mark({"pids": [1]})
    img.close()  # a second close does nothing
    assert len(os.listdir("/proc/self/fd")) == before
