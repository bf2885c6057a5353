# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Image directories kept in memory: a tmpfs of the image's own, mounted on its directory.

A migration's source image is needed only until the target runs (the source is held meanwhile, and its
way back is the held process, or, where it had to exit, this image). Writing it to the source's disk
costs the dump the disk's bandwidth and the manifest's fsync a flush of the whole image. Kept in
memory, the image is written at memory speed and gone with the migration's settlement.

Why a tmpfs of its own and not a directory in /dev/shm:
- its ``size=`` caps this image alone: a dump that outgrows the estimate fails with ENOSPC and is
  rolled back (the source thawed), instead of taking the host's last memory, where the OOM killer
  could pick the job itself;
- it lives in no shared, world-writable directory where another user could plant a name first;
- it is removed as a whole (``fsutil.remove_tree`` unmounts it: its identity is its root's).

Its pages are large folios where the kernel has them for tmpfs (``huge=within_size``): a page file is
written, hashed and sent in pieces of up to 2 MiB instead of 4 KiB, and no small file of CRIU's takes
more than its size (``always`` would give each one a whole 2 MiB). GPUCKPT_IMAGE_TMPFS_HUGE in the
module's environment sets another policy (``always``, ``advise``, ``never``); a kernel that refuses the
option gets a plain tmpfs.

Its mount source is MOUNT_SOURCE, so that a mount of ours is told from any other tmpfs (a user's image
root on tmpfs is never unmounted). Plain Python with the standard library only (ctypes for mount(2)), and
it imports nothing of ours: fsutil.remove_tree uses it, in the transfer's receiver program too.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

MOUNT_SOURCE = "gpuckpt-image"
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PAGE = 4096
RESERVE_FRACTION, RESERVE_MIN = 0.05, 2**30
HUGE_ENV = "GPUCKPT_IMAGE_TMPFS_HUGE"
HUGE_POLICIES = ("within_size", "always", "advise", "never")
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
EINVAL = 22


def reserve_bytes(total_bytes):
    """What a host keeps free for everything else while an image is in its memory: 5 % of its RAM, at
    least 1 GiB (the checkpoint's check before the freeze, and the migration planner's)."""
    return max(RESERVE_MIN, int(total_bytes * RESERVE_FRACTION))


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def huge_policy(environ=None, shmem_thp=SHMEM_THP):
    """The tmpfs ``huge=`` policy for an image's mount (see the module doc), or None for none: a kernel
    without transparent huge pages for shmem has no such option. Raises ValueError for an unknown policy."""
    policy = (os.environ if environ is None else environ).get(HUGE_ENV) or "within_size"
    if policy not in HUGE_POLICIES:
        raise ValueError("%s=%r is not one of %s" % (HUGE_ENV, policy, ", ".join(HUGE_POLICIES)))
    if policy == "never" or not os.path.exists(shmem_thp):
        return None
    return policy


def mount_image_dir(path, size_bytes, huge=None):
    """Mount a tmpfs of ``size_bytes`` (rounded up to pages), mode 0700, on the empty directory ``path``,
    with the ``huge=`` policy ``huge`` where the kernel takes it (a plain tmpfs where it refuses it).
    Returns its root's identity [dev, ino]. Raises OSError (EPERM without CAP_SYS_ADMIN)."""
    size = -(-int(size_bytes) // PAGE) * PAGE
    opts = "size=%d,mode=0700,uid=%d,gid=%d" % (size, os.geteuid(), os.getegid())
    for extra in ([",huge=" + huge] if huge else []) + [""]:
        if _libc().mount(MOUNT_SOURCE.encode(), os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                         (opts + extra).encode()) == 0:
            break
        err = ctypes.get_errno()
        if not (extra and err == EINVAL):
            raise OSError(err, "cannot mount a tmpfs on %s: %s" % (path, os.strerror(err)))
    st = os.lstat(path)
    return [st.st_dev, st.st_ino]


def huge_of(path):
    """The ``huge=`` policy the tmpfs at ``path`` was mounted with, or "never"."""
    m = mount_of(path) or {}
    for opt in m.get("options", "").split(","):
        if opt.startswith("huge="):
            return opt[len("huge="):]
    return "never"


def _unescape(field):
    """A path as /proc/self/mountinfo writes it (space, tab, newline and backslash as octal escapes)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path):
    """{"fstype", "source", "options"} of the mount whose mount point is ``path`` in this mount
    namespace (the last such mount, the one seen there), or None when ``path`` is no mount point."""
    path = os.path.realpath(path)
    found = None
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields:
            continue
        sep = fields.index("-")
        if _unescape(fields[4]) == path and len(fields) > sep + 2:
            found = {"fstype": fields[sep + 1], "source": _unescape(fields[sep + 2]),
                     "options": fields[sep + 3] if len(fields) > sep + 3 else ""}
    return found


def is_image_mount(path):
    """Whether ``path`` is the root of an image tmpfs this module mounted."""
    m = mount_of(path)
    return bool(m) and m["fstype"] == "tmpfs" and m["source"] == MOUNT_SOURCE


def unmount(path):
    """Detach the image tmpfs at ``path`` (its memory is freed once nothing holds a file of it open)."""
    if _libc().umount2(os.fsencode(path), 2) != 0:  # MNT_DETACH: an fd still open elsewhere cannot block it
        err = ctypes.get_errno()
        raise OSError(err, "cannot unmount the image tmpfs at %s: %s" % (path, os.strerror(err)))


def usage(path):
    """{"size_bytes", "used_bytes"} of the file system at ``path``."""
    st = os.statvfs(path)
    return {"size_bytes": st.f_blocks * st.f_frsize, "used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize}
