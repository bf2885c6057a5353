"""A restore opens its image once (image.Image) and hands that value around: its manifest is read once,
its checks and its restored mark go through the directory it opened, and an image its caller opened
(a source's rollback) is used as it is. The TEST DOUBLE backend is the shared RecordingBackend
(tests/unit/conftest.py), the driver test_steps'."""
from __future__ import annotations

import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import ImageError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore

pytestmark = pytest.mark.usefixtures("no_host_facts")  # (tests/unit/engine/conftest.py)


@pytest.fixture
def counted(monkeypatch):
    """How many times the restore opens an image, and reads a manifest."""
    counts = {"opens": 0, "manifest_reads": 0}
    open_image, parse = image.Image.open.__func__, image.parse_manifest

    def opening(cls, path, manifest=None):
        counts["opens"] += 1
        return open_image(cls, path, manifest)

    def parsing(data, where):
        counts["manifest_reads"] += 1
        return parse(data, where)

    monkeypatch.setattr(image.Image, "open", classmethod(opening))
    monkeypatch.setattr(image, "parse_manifest", parsing)
    return counts


def test_a_restore_opens_its_image_once_and_reads_its_manifest_once(workload, tmp_path, counted, doubles, recording_backend,
                                                                    gpu_given_back, checkpointed_image):
    root, b, c = workload
    image_dir, drv = checkpointed_image()
    log = []
    drv.log = log
    counted.update(opens=0, manifest_reads=0)
    res = restore(image_dir, backend=recording_backend(log, workload, drv), parallel=False, validate_wait=0, pid_wait=0)
    assert log == [("runtime_restore",)] + gpu_given_back(b, c)
    assert counted == {"opens": 1, "manifest_reads": 1}
    with image.Image.open(image_dir) as img:
        assert img.restored_mark()["pids"] == res["pids"] == workload
    # Its workload runs: a second restore of the same image has nothing to do.
    again = restore(image_dir, backend=recording_backend(log, workload, drv), pid_wait=0)
    assert again["changed"] is False and "nothing to do" in again["msg"]


def test_a_restore_handed_an_open_image_uses_it_and_leaves_it_open(workload, tmp_path, counted, doubles, recording_backend, checkpointed_image):
    root, b, c = workload
    image_dir, drv = checkpointed_image()
    log = []
    drv.log = log
    with image.Image.open(image_dir) as img:
        assert img.manifest["target"]["cuda_pids"] == [b, c]
        counted.update(opens=0, manifest_reads=0)
        res = restore(img, backend=recording_backend(log, workload, drv), parallel=False, validate_wait=0,
                      pid_wait=0)
        assert counted == {"opens": 0, "manifest_reads": 0}
        assert res["image_dir"] == image_dir and res["pids"] == workload
        assert img.restored_mark()["pids"] == workload, "the caller's image is still open"


def test_a_symlink_given_as_the_image_is_refused_before_anything_is_restored(workload, tmp_path, doubles, recording_backend, checkpointed_image):
    image_dir, drv = checkpointed_image()
    link = str(tmp_path / "link")
    os.symlink(image_dir, link)
    log = []
    with pytest.raises(ImageError, match="a symlink"):
        restore(link, backend=recording_backend(log, workload, drv), pid_wait=0)
    assert log == []
