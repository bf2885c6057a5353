# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a Docker restore leaves behind in containerd, and its removal: dockerd hands a checkpoint to
containerd as content, and containerd's Tasks.Create unpacks it into a ``ctrd-checkpoint*`` directory
that it never removes (Docker 20.10 and 26 alike; a full CRIU image, pages included, per restore).

Each restore puts a file of its own (RESTORE_ID) into the checkpoint it hands to dockerd, so that
containerd's copy names the restore it belongs to, and who made it: the restore removes its own copy
when ``docker start --checkpoint`` returns. A copy whose restore never got there (its module was
killed; its ``docker start`` was cut off by the runtime timeout while containerd still unpacked) is
removed by the next Docker restore on that host, once the process that made it no longer runs.

(The checkpoint's content blob that dockerd uploads is deleted by dockerd itself once the task is
created; containerd's garbage collector removes the file within a second: nothing to do here.)"""
from __future__ import annotations

import os
import stat
import uuid

from ..core import procfs
from ..core.fsutil import UnsafePath, identity, open_beneath, open_dir, remove_tree

RESTORE_ID = "gpuckpt-restore-id"  # a file of each restore's own in the checkpoint it hands to dockerd
CONTAINERD_COPY_PREFIX = "ctrd-checkpoint"  # containerd's Tasks.Create unpacks an uploaded checkpoint there
CONTAINERD_COMMS = ("containerd",)  # a containerd's process name (dockerd's own, or the system's)


def new_restore_id():
    """A new restore's id, with the process that makes it: "<random> <boot id> <pid namespace> <pid>
    <start time>". The restore's own module process: while it runs, its copy is in use."""
    me = os.getpid()
    start = (procfs.read_stat(me) or {}).get("starttime", 0)
    return "%s %s %s %d %d" % (uuid.uuid4().hex, procfs.boot_id() or "-", procfs.pid_namespace() or "-", me, start)


def _maker_gone(text):
    """True when the restore id ``text`` names a process that surely no longer runs: one of another boot,
    or one of this pid namespace that is gone (its pid free, or reused by a later process). An id of
    another pid namespace (another loopback host, a module in a container), or one without its maker
    (before new_restore_id), is never judged."""
    parts = text.split()
    if len(parts) != 5 or not parts[3].isdigit() or not parts[4].isdigit():
        return False
    boot = procfs.boot_id()
    if boot and parts[1] not in ("-", boot):
        return True
    if parts[2] == "-" or parts[2] != procfs.pid_namespace():
        return False
    st = procfs.read_stat(int(parts[3]))
    return st is None or st.get("starttime") != int(parts[4])


def _containerd_temp_dirs():
    """Where each containerd on this host makes its temporary directories (Go's os.MkdirTemp: its
    XDG_RUNTIME_DIR, else its TMPDIR, else /tmp), seen through its own root (a service with a private
    /tmp has its own); and this process's own, for a containerd it cannot see (one in another pid
    namespace than this module's)."""
    out = {os.environ.get("TMPDIR") or "/tmp"}
    for pid in procfs.all_pids():
        if (procfs.read_stat(pid) or {}).get("comm") not in CONTAINERD_COMMS:
            continue
        env = procfs.environ(pid)
        where = env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"
        out.add("/proc/%d/root/%s" % (pid, where.lstrip("/")))
    return sorted(out)


def remove_containerd_copies(restore_id):
    """Remove containerd's copy of this restore's checkpoint (the ``ctrd-checkpoint*`` directory that
    holds this restore's RESTORE_ID), and any copy of an earlier restore whose maker no longer runs
    (see _maker_gone); nothing else. Returns the paths removed."""
    removed = []
    for tmp in _containerd_temp_dirs():  # (one directory seen through several roots is gone at the second)
        try:
            names = [n for n in os.listdir(tmp) if n.startswith(CONTAINERD_COPY_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(tmp, name)
            found = _restore_id_of(path)
            if found and (found[0] == restore_id or _maker_gone(found[0])):
                try:
                    if remove_tree(path, found[1]):
                        removed.append(path)
                except OSError:
                    pass
    return removed


def _restore_id_of(path):
    """(the RESTORE_ID text, the directory's identity) of a copy at ``path``: a directory of root's, not
    a symlink, holding that file; else None."""
    try:
        dir_fd = open_dir(path)
    except (OSError, UnsafePath):
        return None
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != 0 or not stat.S_ISDIR(st.st_mode):
            return None
        fd = open_beneath(dir_fd, RESTORE_ID, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return os.read(fd, 256).decode("ascii", "replace").strip(), identity(st)
        finally:
            os.close(fd)
    except (OSError, UnsafePath):
        return None
    finally:
        os.close(dir_fd)
