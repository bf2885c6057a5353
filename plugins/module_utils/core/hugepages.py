# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Transparent huge pages while a checkpoint or a restore runs (``host_huge_pages``).

Measured on the GPU machines (docs/benchmarks): with THP ``always`` instead of those VMs' ``madvise``,
the driver's checkpoint (it fills host memory inside the CUDA process) and CRIU's restore (it fills
the restored process's memory) ran 1.5-1.8x faster: host memory population bounds both there, not
PCIe or the disk. Neither the driver nor CRIU asks for huge pages (no madvise), and a process cannot
ask on their behalf, so the lever is the host's setting: with ``host_huge_pages`` an operation sets
``always`` for its own duration and puts back what was there.

- Each operation that wants it registers as a holder (a file named by its process identity: pid,
  start time, boot) in STATE_DIR, under an flock; the first records the mode it found, the last to
  leave puts it back. Two operations at once on one host share the setting.
- A holder that died (its module was killed) is pruned by the next operation on the host, with or
  without the option (settle()), and by gpu_migration's actions (a migration's settlement,
  recover.yml): the setting stays changed no longer than until the collection next acts there.
- A holder records its pid namespace too. A process in another pid namespace of the host (its own /proc) cannot
  tell whether that holder lives, so it leaves it to an operation of that namespace: pruned from there, it would
  have the setting put back under the holder's running operation (seen with the tests' loopback hosts, which share
  /run and each have their own pid namespace).
- What is put back is put back only while the setting still reads ``always``: a change an
  administrator made meanwhile is kept.
- STATE_DIR is on /run (a tmpfs): a reboot forgets the record together with the setting.
- The trade-off while it holds: other processes' new anonymous memory also gets huge pages (more
  memory per sparse mapping); for minutes, not for the life of the host. The ``criu_thp_mode``
  variable of the criu role sets it for good instead, where an operator prefers that.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time

from .fsutil import atomic_write, check_private_ancestors, make_dirs_private, read_json
from .journal import process_identity, same_process

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
STATE_DIR = "/run/gpuckpt/thp"
WANTED = "always"
PREVIOUS = "previous.json"
HOLDER_PREFIX = "holder-"


def read_mode(sysfs=THP_ENABLED):
    """The active mode: the bracketed word of ``always [madvise] never``."""
    with open(sysfs) as fh:
        text = fh.read().strip()
    if "[" in text:
        return text[text.index("[") + 1:text.index("]")]
    return text


def _write_mode(sysfs, mode):
    with open(sysfs, "w") as fh:
        fh.write(mode)


class _Locked(object):
    def __init__(self, state_dir):
        self.state_dir = state_dir

    def __enter__(self):
        make_dirs_private(self.state_dir)
        check_private_ancestors(self.state_dir)
        self.fd = os.open(os.path.join(self.state_dir, "lock"),
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # the kernel releases the flock with the fd (and with a killed holder)


def _pid_namespace():
    """This process's pid namespace ("pid:[4026531836]"), or None where it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _holders(state_dir):
    """{name: identity} of the holders recorded; those that died are removed. A holder of another pid namespace is
    kept: this /proc cannot tell whether it lives."""
    live = {}
    here = _pid_namespace()
    for name in os.listdir(state_dir):
        if not name.startswith(HOLDER_PREFIX):
            continue
        path = os.path.join(state_dir, name)
        ident = read_json(path)
        try:
            elsewhere = isinstance(ident, dict) and ident.get("pid_ns") not in (None, here) and here is not None
            alive = elsewhere or (isinstance(ident, dict) and same_process(ident))
        except (KeyError, TypeError, ValueError):
            alive = False  # not a record we wrote
        if alive:
            live[name] = ident
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return live


def _put_back(sysfs, state_dir):
    """With no holder left: the recorded mode back, if the setting is still ours. Returns it or None."""
    prev_path = os.path.join(state_dir, PREVIOUS)
    prev = read_json(prev_path)
    if not isinstance(prev, dict) or not prev.get("mode"):
        return None
    if read_mode(sysfs) == WANTED and prev["mode"] != WANTED:
        _write_mode(sysfs, prev["mode"])
    os.unlink(prev_path)
    return prev["mode"]


def settle(sysfs=THP_ENABLED, state_dir=STATE_DIR):
    """Put the setting back when every holder has gone (a killed module's included). Never raises:
    returns a note, or None when there was nothing to do."""
    if not os.path.isdir(state_dir):
        return None
    try:
        with _Locked(state_dir):
            if not _holders(state_dir):
                mode = _put_back(sysfs, state_dir)
                if mode:
                    return "transparent huge pages put back to %s (its holder had gone)" % mode
    except (OSError, ValueError) as exc:
        return "transparent huge pages could not be settled: %s" % exc
    return None


class HugePages(object):
    """``with HugePages(wanted):`` THP ``always`` inside (when wanted), as it was afterwards. A host
    where it cannot be set (no THP, a read-only sysfs in a container) does not fail the operation:
    ``report`` says why, and the operation runs at the host's setting."""

    def __init__(self, wanted, sysfs=THP_ENABLED, state_dir=STATE_DIR, settle_stale=True):
        self.wanted, self.sysfs, self.state_dir = bool(wanted), sysfs, state_dir
        self.settle_stale = settle_stale  # False in check mode: it changes nothing on the host
        self.holder = None
        self.report = None

    def __enter__(self):
        note = settle(self.sysfs, self.state_dir) if self.settle_stale else None
        if not self.wanted:
            if note:
                self.report = {"requested": False, "note": note}
            return self
        try:
            before = read_mode(self.sysfs)
            with _Locked(self.state_dir):
                holders = _holders(self.state_dir)
                prev_path = os.path.join(self.state_dir, PREVIOUS)
                if not holders and read_json(prev_path) is None:
                    atomic_write(prev_path, {"mode": before, "recorded": time.time()})
                ident = dict(process_identity(os.getpid()), pid_ns=_pid_namespace())
                self.holder = os.path.join(self.state_dir, "%s%d-%d" % (HOLDER_PREFIX, ident["pid"], ident["starttime"]))
                atomic_write(self.holder, ident)
                if before != WANTED:
                    _write_mode(self.sysfs, WANTED)
            self.report = {"requested": True, "mode": WANTED, "previous": before}
        except (OSError, ValueError) as exc:
            reason = "not available on this host" if getattr(exc, "errno", None) == errno.ENOENT else str(exc)
            self.report = {"requested": True, "error": "transparent huge pages could not be set: %s" % reason}
            self._leave()
        return self

    def _leave(self):
        if self.holder is None:
            return
        try:
            with _Locked(self.state_dir):
                try:
                    os.unlink(self.holder)
                except FileNotFoundError:
                    pass
                self.holder = None
                if not _holders(self.state_dir):
                    put_back = _put_back(self.sysfs, self.state_dir)
                    if put_back and self.report:
                        self.report["put_back"] = put_back
        except (OSError, ValueError) as exc:  # the next operation or facts settle it
            if self.report is not None:
                self.report["error"] = "transparent huge pages could not be put back yet: %s" % exc

    def __exit__(self, *exc):
        self._leave()
