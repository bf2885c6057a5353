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


def test_the_huge_policy_is_within_size_unless_the_environment_says_otherwise(tmp_path):
    thp = tmp_path / "shmem_enabled"
    thp.write_text("always within_size advise [never] deny force\n")
    assert memdir.huge_policy({}, str(thp)) == "within_size"
    assert memdir.huge_policy({memdir.HUGE_ENV: "always"}, str(thp)) == "always"
    assert memdir.huge_policy({memdir.HUGE_ENV: "never"}, str(thp)) is None
    assert memdir.huge_policy({}, str(tmp_path / "no-thp")) is None, "a kernel without shmem THP has no huge="
    with pytest.raises(ValueError, match="GPUCKPT_IMAGE_TMPFS_HUGE"):
        memdir.huge_policy({memdir.HUGE_ENV: "2M"}, str(thp))


@pytest.mark.skipif(not os.path.exists(memdir.SHMEM_THP), reason="this kernel has no transparent huge pages for tmpfs")
def test_an_image_tmpfs_takes_large_folios_within_its_files_sizes(tmp_path):
    d = str(tmp_path / "img")
    fsutil.create_private_dir(d)
    ident = memdir.mount_image_dir(d, 64 * 2**20, "within_size")
    try:
        assert memdir.huge_of(d) == "within_size"
        for i in range(8):  # CRIU's small images: within_size gives none of them more than its size
            with open(os.path.join(d, "core-%d.img" % i), "wb") as fh:
                fh.write(b"c" * 100)
        assert memdir.usage(d)["used_bytes"] < 2**20
    finally:
        assert fsutil.remove_tree(d, ident)


def test_a_kernel_that_refuses_the_huge_option_gets_a_plain_tmpfs(tmp_path, monkeypatch):
    real = memdir._libc()

    class RefusesHuge(object):
        def mount(self, source, target, fstype, flags, data):
            if b"huge=" in data:
                import ctypes
                ctypes.set_errno(memdir.EINVAL)
                return -1
            return real.mount(source, target, fstype, flags, data)

    monkeypatch.setattr(memdir, "_libc", RefusesHuge)
    d = str(tmp_path / "img")
    fsutil.create_private_dir(d)
    ident = memdir.mount_image_dir(d, 2**20, "within_size")
    assert memdir.is_image_mount(d) and memdir.huge_of(d) == "never"
    monkeypatch.undo()
    assert fsutil.remove_tree(d, ident)
