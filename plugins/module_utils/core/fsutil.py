# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Files that root writes, written so that nobody else can steer or read them.

- Never through a symlink: every open of a path that someone else could have planted uses
  O_NOFOLLOW, component by component below a directory that was opened the same way.
- Never a predictable name in a shared directory: temporary files get random names and O_EXCL.
- Never readable by others on the way: directories are created 0700 and files 0600 from their first
  byte (the mode is given to mkdir/open, not set afterwards).
- Replaced atomically: write a new file, fsync it, rename it over the old one (one helper:
  ``atomic_write``). With ``reserve``, a write that meets a full disk first gives up a spare file
  kept for that moment, so a rollback can still record what it did.
- Removed only when it is what we created: ``remove_tree`` checks the directory's identity (device and
  inode, recorded when it was created) before removing anything; an image directory kept in memory
  (a tmpfs of its own, memdir.py) is emptied and unmounted.

Plain Python with the standard library only: it is also sent, as source, to the receiving end of a
transfer (see transfer/streams.receiver_program).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat

from .memdir import is_image_mount, unmount

DIR_MODE = 0o700
FILE_MODE = 0o600


class UnsafePath(Exception):
    """A path that root must not write: a symlink, a directory others can write, not ours."""


def identity(st):
    """What names one file on this host for as long as it exists: [device, inode]."""
    return [st.st_dev, st.st_ino]


def _split(rel):
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or rel.startswith("/") or ".." in parts or "\0" in rel:
        raise UnsafePath("refusing path %r: it must be relative, below the directory, without '..'" % rel)
    return parts


def open_dir(path):
    """An fd on directory ``path``, refusing a symlink in its last component."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath("%s is not a directory (a symlink or a file stands there)" % path)
        raise


def open_beneath(dir_fd, rel, flags=os.O_RDONLY, mode=FILE_MODE, make_dirs=False):
    """Open ``rel`` below the directory ``dir_fd``, following no symlink on the way: every
    intermediate directory is opened with O_NOFOLLOW (and created 0700 with ``make_dirs``), the last
    component too. Returns an fd."""
    parts = _split(rel)
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            if make_dirs:
                try:
                    os.mkdir(part, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath("%s in %r is not a directory (a symlink or a file stands there)" % (part, rel))
                raise
            os.close(fd)
            fd = nfd
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath("%s is a symlink; refusing to follow it" % rel)
            raise
    finally:
        os.close(fd)


def remove_regular_file(dir_fd, name):
    """Remove ``name`` in the directory open as ``dir_fd`` when it is a regular file there (a symlink or anything
    else planted under that name stays). True when one was removed; ``dir_fd`` stays open."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _random_name(name):
    return ".%s.%s.tmp" % (name, os.urandom(6).hex())


def atomic_write(path, data, mode=FILE_MODE, dir_fd=None, reserve=None):
    """Replace the file ``path`` (a name in ``dir_fd`` when given) with ``data`` (bytes, str, or an
    object written as JSON), atomically: a new file with a random name (O_EXCL, never through a
    symlink), fsynced, renamed over ``path``. A symlink planted at ``path`` is replaced, not followed.
    ``reserve``: a Reserve to give up when the disk is full, then write again once."""
    if not isinstance(data, (bytes, str)):
        data = json.dumps(data, indent=1, sort_keys=True, default=str)
    if isinstance(data, str):
        data = data.encode("utf-8")
    folder, name = os.path.split(path)
    own_fd = None
    if dir_fd is None:
        own_fd = dir_fd = open_dir(folder or ".")
    try:
        for attempt in (0, 1):
            tmp = _random_name(name)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                             dir_fd=dir_fd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                return
            except OSError as exc:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
                if exc.errno == errno.ENOSPC and attempt == 0 and reserve is not None and reserve.release():
                    continue
                raise
    finally:
        if own_fd is not None:
            os.close(own_fd)


def read_json(path, dir_fd=None):
    """The JSON in ``path`` (never through a symlink), or None when it is absent or unreadable."""
    try:
        if dir_fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        else:
            fd = open_beneath(dir_fd, path)
    except (OSError, UnsafePath):
        return None
    with os.fdopen(fd, "rb") as fh:
        try:
            return json.loads(fh.read().decode("utf-8"))
        except ValueError:
            return None


class Reserve(object):
    """A spare file in a directory, given up when the disk is full so that one more small write
    (a journal entry saying what a rollback did) still fits."""

    SIZE = 256 * 1024

    def __init__(self, folder, name=".reserve"):
        self.path = os.path.join(folder, name)

    def ensure(self):
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except OSError:
            return  # there already, or no room for it now
        try:
            os.write(fd, b"\0" * self.SIZE)  # real blocks: posix_fallocate is not on every filesystem
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            return
        os.close(fd)

    def release(self):
        try:
            os.unlink(self.path)
            return True
        except OSError:
            return False


def check_private_ancestors(path):
    """Refuse ``path`` when someone other than root (or us) could replace it or one of its ancestors:
    each directory above it must be owned by root or by us, and not writable by group or others,
    unless it is sticky (like /tmp) and its entry on the way is ours (or, for ``path`` itself, is not
    there yet: we are about to create it, and nobody else can remove our entry from a sticky
    directory). The same rule as sshd's StrictModes."""
    real = os.path.realpath(path)
    ours = (0, os.geteuid())
    parts = real.split("/")[1:]
    current = "/"
    for i, part in enumerate(parts):  # each directory that holds the next component, down to path's parent
        st = os.lstat(current)
        nxt = os.path.join(current, part)
        if st.st_uid not in ours:
            raise UnsafePath("%s is owned by uid %d: another user could replace %s" % (current, st.st_uid, path))
        if st.st_mode & 0o022:
            try:
                child_uid = os.lstat(nxt).st_uid
            except OSError:
                child_uid = "new" if i == len(parts) - 1 else None
            if not (st.st_mode & stat.S_ISVTX and child_uid in ours + ("new",)):
                raise UnsafePath("%s is writable by other users (mode %o): another user could replace %s"
                                 % (current, stat.S_IMODE(st.st_mode), path))
        current = nxt
    return real


def make_dirs_private(path):
    """Create the missing directories of ``path`` with mode 0700 (existing ones are left as they are)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass


def create_private_dir(path):
    """Create the directory ``path`` (0700, new: it must not exist) below safe ancestors, creating
    its missing parents 0700. Returns its identity. Raises UnsafePath or FileExistsError."""
    parent = os.path.dirname(os.path.abspath(path))
    make_dirs_private(parent)
    check_private_ancestors(path)
    os.mkdir(path, DIR_MODE)
    st = os.lstat(path)
    return identity(st)


def same_dir(path, ident):
    """True when ``path`` is (still) the directory of identity ``ident`` and not a symlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and ident is not None and identity(st) == list(ident)


def remove_tree(path, ident):
    """Remove the directory ``path`` and all below it, only when it is the directory of identity
    ``ident`` (the one we created). shutil.rmtree walks by file descriptor and never follows a symlink.
    Returns True when something was removed."""
    if not same_dir(path, ident):
        return False
    if is_image_mount(path):  # an image kept in memory (memdir.py): its identity is its tmpfs's root
        for entry in os.listdir(path):
            p = os.path.join(path, entry)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        unmount(path)
        try:
            os.rmdir(path)  # the directory it was mounted on, created with it (empty: refused otherwise)
        except OSError:
            pass
        return True
    shutil.rmtree(path)
    return True
