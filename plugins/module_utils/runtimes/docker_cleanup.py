# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a Docker restore leaves behind in containerd, and its removal: dockerd hands a checkpoint to
containerd as content, and containerd's Tasks.Create unpacks it into a ``ctrd-checkpoint*`` directory
that it never removes."""
from __future__ import annotations

import os
import shutil
import stat

from ..core import procfs
from ..core.fsutil import UnsafePath, open_beneath, open_dir

RESTORE_ID = "gpuckpt-restore-id"  # a file of each restore's own in the checkpoint it hands to dockerd
CONTAINERD_COPY_PREFIX = "ctrd-checkpoint"  # containerd's Tasks.Create unpacks an uploaded checkpoint there


def _containerd_temp_dirs():
    """Where each containerd on this host makes its temporary directories (Go's os.MkdirTemp: its
    XDG_RUNTIME_DIR, else its TMPDIR, else /tmp), seen through its own root (a service with a private
    /tmp has its own)."""
    out = set()
    for pid in procfs.all_pids():
        if (procfs.read_stat(pid) or {}).get("comm") != "containerd":
            continue
        env = procfs.environ(pid)
        where = env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"
        out.add("/proc/%d/root/%s" % (pid, where.lstrip("/")))
    return sorted(out) or ["/tmp"]


def remove_containerd_copies(restore_id):
    """dockerd hands a checkpoint to containerd as content, and containerd's Tasks.Create unpacks it into
    a new ``ctrd-checkpoint*`` directory that it never removes: a full CRIU image (pages included) per
    restore. Remove the one that holds this restore's own id (RESTORE_ID); nothing else. Returns the
    paths removed."""
    removed = []
    for tmp in _containerd_temp_dirs():
        try:
            names = [n for n in os.listdir(tmp) if n.startswith(CONTAINERD_COPY_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(tmp, name)
            if _holds_restore_id(path, restore_id):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _holds_restore_id(path, restore_id):
    try:
        dir_fd = open_dir(path)
    except (OSError, UnsafePath):
        return False
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != 0 or not stat.S_ISDIR(st.st_mode):
            return False
        fd = open_beneath(dir_fd, RESTORE_ID, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return os.read(fd, 256).decode("ascii", "replace").strip() == restore_id
        finally:
            os.close(fd)
    except (OSError, UnsafePath):
        return False
    finally:
        os.close(dir_fd)
