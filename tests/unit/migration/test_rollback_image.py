"""What a rolled-back migration does with the source's image once the source runs again: removed and named,
kept and named when asked, and left alone when it is not the directory the checkpoint wrote."""
from __future__ import annotations

import os

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.fsutil import create_private_dir
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.transaction import _settle_source_image


def _image(tmp_path):
    path = str(tmp_path / "images" / "m-1")
    os.makedirs(os.path.dirname(path), mode=0o700)
    ident = create_private_dir(path)
    with open(os.path.join(path, "pages-1.img"), "wb") as fh:
        fh.write(b"x" * 4096)
    return {"image_dir": path, "image_dir_identity": ident, "image_dir_created": True}


def test_the_image_is_removed_and_named(tmp_path):
    doc = _image(tmp_path)
    note, how = _settle_source_image(doc, False, "source resumed (pids [1])")
    assert note == {"image_removed": doc["image_dir"]}
    assert doc["image_dir"] in how and not os.path.exists(doc["image_dir"])


def test_a_kept_image_is_named(tmp_path):
    doc = _image(tmp_path)
    note, how = _settle_source_image(doc, True, "source resumed")
    assert note == {"image_kept": doc["image_dir"]} and "kept in %s" % doc["image_dir"] in how
    assert os.path.exists(os.path.join(doc["image_dir"], "pages-1.img"))


def test_another_directory_in_its_place_is_left_alone(tmp_path):
    doc = _image(tmp_path)
    os.rename(doc["image_dir"], doc["image_dir"] + ".moved")
    os.mkdir(doc["image_dir"], 0o700)
    note, how = _settle_source_image(doc, False, "source resumed")
    assert note == {"image_kept": doc["image_dir"]} and "left alone" in how
    assert os.path.isdir(doc["image_dir"])


def test_a_directory_that_existed_before_keeps_itself_but_not_the_image(tmp_path):
    doc = dict(_image(tmp_path), image_dir_created=False)
    note, unused = _settle_source_image(doc, False, "source resumed")
    assert note == {"image_removed": doc["image_dir"]}
    assert os.path.isdir(doc["image_dir"]) and os.listdir(doc["image_dir"]) == []


def test_no_image_no_note(tmp_path):
    assert _settle_source_image({"image_dir": str(tmp_path / "gone")}, False, "x") == ({}, "x")
