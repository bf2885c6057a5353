"""core/memdir.py: an image directory in a tmpfs of its own, mounted and removed by identity (root only:
mount(2) needs CAP_SYS_ADMIN; CI runs as root)."""
from __future__ import annotations

import os
import subprocess

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import fsutil, memdir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def mounts_at(path):
    with open("/proc/self/mountinfo") as fh:
        return [line for line in fh if (" %s " % os.path.realpath(path)) in line]


def test_a_mounted_image_dir_is_sized_private_and_removed_with_its_mount(tmp_path):
    d = str(tmp_path / "img")
    made = fsutil.create_private_dir(d)
    ident = memdir.mount_image_dir(d, 3 * 2**20 + 1)
    assert ident != made and memdir.is_image_mount(d)
    m = memdir.mount_of(d)
    assert m["fstype"] == "tmpfs" and m["source"] == memdir.MOUNT_SOURCE and "mode=700" in m["options"]
    assert memdir.usage(d)["size_bytes"] == 3 * 2**20 + 4096  # rounded up to a page
    os.makedirs(os.path.join(d, "state"))
    with open(os.path.join(d, "pages-1.img"), "wb") as fh:
        fh.write(b"x" * 2**20)
    with pytest.raises(OSError):  # the cap holds: no more than its size
        with open(os.path.join(d, "big"), "wb") as fh:
            fh.write(b"y" * (4 * 2**20))
    assert not fsutil.remove_tree(d, made), "the identity of the directory under the mount is not the image's"
    assert fsutil.remove_tree(d, ident)
    assert not os.path.exists(d) and not mounts_at(d)


def test_a_tmpfs_of_someone_else_is_never_unmounted(tmp_path):
    d = str(tmp_path / "theirs")
    os.mkdir(d, 0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "other", d], check=True)
    try:
        assert memdir.mount_of(d)["source"] == "other" and not memdir.is_image_mount(d)
        with open(os.path.join(d, "f"), "w") as fh:
            fh.write("kept")
        st = os.lstat(d)
        with pytest.raises(OSError):
            fsutil.remove_tree(d, [st.st_dev, st.st_ino])  # rmtree empties it, then cannot remove a mount point
        assert mounts_at(d), "a foreign tmpfs stays mounted"
    finally:
        subprocess.run(["umount", d], check=True)


def test_a_path_with_a_space_is_found_in_mountinfo(tmp_path):
    d = str(tmp_path / "with space")
    made = fsutil.create_private_dir(d)
    ident = memdir.mount_image_dir(d, 2**20)
    assert memdir.is_image_mount(d) and made != ident
    assert fsutil.remove_tree(d, ident) and not os.path.exists(d)


def test_the_reserve_is_five_percent_and_at_least_a_gib():
    assert memdir.reserve_bytes(8 * 2**30) == 2**30
    assert memdir.reserve_bytes(256 * 2**30) == int(256 * 2**30 * 0.05)
