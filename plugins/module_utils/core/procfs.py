# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""This host's /proc, read in one place: process trees, states and identities, namespaces, cgroups,
memory, file locks, environments and mappings (the sockets a tree holds and the network namespace's
TCP and unix socket tables: core/sockets.py). Standard library only (the receiver and the engine share
it: the journal that the transfer's receiver program carries names processes from here)."""
from __future__ import annotations

import os
import re
import stat

from .errors import InvalidTarget
from .wait import wait_for

PF_KTHREAD = 0x00200000


def read_stat(pid):
    """Fields of /proc/<pid>/stat that we use, or None when the pid does not exist."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
        comm = data[data.index("(") + 1:data.rindex(")")]
        rest = data[data.rindex(")") + 2:].split()
        return {"pid": pid, "comm": comm, "state": rest[0], "ppid": int(rest[1]), "pgrp": int(rest[2]),
                "session": int(rest[3]), "tty_nr": int(rest[4]), "flags": int(rest[6]), "starttime": int(rest[19])}
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid):
    """The state letter of ``pid`` (R, S, T, Z, ...), or None when it does not exist."""
    return (read_stat(pid) or {}).get("state")


def boot_id():
    """This boot's id (a process identity holds it: a pid of another boot is not the same process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _status_field(pid, name):
    """The words of the line ``name`` of /proc/<pid>/status, or None."""
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return line.split()[1:]
    except OSError:
        pass
    return None


def tracer(pid):
    """The pid tracing ``pid`` (a dump under way: CRIU seizes the tree it dumps), 0 when none, None when unknown."""
    words = _status_field(pid, "TracerPid")
    try:
        return int(words[0]) if words else None
    except ValueError:
        return None


def ns_pid(pid):
    """The pid inside the innermost pid namespace (the last NSpid field), or None."""
    words = _status_field(pid, "NSpid")
    try:
        return int(words[-1]) if words else None
    except ValueError:
        return None


def rss_bytes(pid):
    """The resident memory of ``pid`` in bytes (VmRSS); 0 when unread (a kernel thread, a pid gone)."""
    words = _status_field(pid, "VmRSS")
    return int(words[0]) * 1024 if words else 0


def meminfo():
    """This host's memory from /proc/meminfo: total and available (MemAvailable: what a restore can take
    without swapping) in bytes, None each where unread."""
    fields = {}
    try:
        with open("/proc/meminfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, sep, value = line.partition(":")
        parts = value.split()
        if sep and parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * 1024
    return {"total_bytes": fields.get("MemTotal"), "available_bytes": fields.get("MemAvailable")}


def usable_cpus(cgroup_root="/sys/fs/cgroup"):
    """The cores this process may run on: its CPU affinity (a cpuset, taskset, a container's cpus), cut
    to the CPU quota (cpu.max) of its cgroup v2 and every ancestor's, rounded up. os.cpu_count() is the
    host's, which oversizes a pool in a container or a per-host cpuset."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    path = unified_cgroup("self")
    while path:
        try:
            with open(os.path.join(cgroup_root, path.lstrip("/"), "cpu.max")) as fh:
                quota, period = (fh.read().split() + ["100000"])[:2]
            if quota != "max" and int(period) > 0:
                cpus = min(cpus, -(-int(quota) // int(period)))
        except (OSError, ValueError):
            pass
        path = None if path == "/" else os.path.dirname(path.rstrip("/")) or "/"
    return max(1, cpus)


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def alive(pid):
    """True when pid exists and is not a zombie."""
    st = read_stat(pid)
    return st is not None and st["state"] not in ("Z", "X")


def all_pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def children_map():
    kids = {}
    for pid in all_pids():
        st = read_stat(pid)
        if st:
            kids.setdefault(st["ppid"], []).append(pid)
    return kids


def process_tree(root):
    """root and all its descendants, parents before children."""
    kids = children_map()
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(kids.get(p, [])))
    return out


def net_namespace(pid="self"):
    """The network namespace of ``pid`` ("net:[<inode>]": equal for processes that share one), or None."""
    try:
        return os.readlink("/proc/%s/ns/net" % pid)
    except OSError:
        return None


def pid_namespace(pid="self"):
    """The pid namespace of ``pid`` ("pid:[<inode>]"), or None."""
    try:
        return os.readlink("/proc/%s/ns/pid" % pid)
    except OSError:
        return None


def ancestors(pid):
    """``pid`` and its ancestors up to (not including) pid 1."""
    out = set()
    while pid > 1:
        st = read_stat(pid)
        if not st:
            break
        out.add(pid)
        pid = st["ppid"]
    return out


def validate_target(pid):
    """Refuse pids we must never freeze; return their stat. Touches nothing."""
    if not isinstance(pid, int) or pid <= 0:
        raise InvalidTarget("pid must be a positive integer, got %r" % (pid,), stage="preflight")
    if pid == 1:
        raise InvalidTarget("pid 1 is the init process of this host (or container); refusing to checkpoint it",
                            stage="preflight", pid=pid)
    st = read_stat(pid)
    if st is None:
        raise InvalidTarget("no process with pid %d on this host" % pid, stage="preflight", pid=pid,
                            hint="check the pid (cuda_process_facts lists CUDA processes)")
    # The flag alone: in a container's pid namespace pid 2 and its children are user processes (kthreadd is
    # pid 2 of the host's namespace only, and kernel threads carry PF_KTHREAD wherever they are seen).
    if st["flags"] & PF_KTHREAD:
        raise InvalidTarget("pid %d (%s) is a kernel thread; only user processes can be checkpointed"
                            % (pid, st["comm"]), stage="preflight", pid=pid)
    if st["state"] in ("Z", "X"):
        raise InvalidTarget("pid %d (%s) is a zombie: it has already exited" % (pid, st["comm"]),
                            stage="preflight", pid=pid)
    if pid in ancestors(os.getpid()):
        raise InvalidTarget("pid %d is this tool's own process or one of its parents" % pid,
                            stage="preflight", pid=pid)
    return st


def _thread_names(pid):
    names = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/comm" % (pid, tid)) as fh:
                    names.append(fh.read().strip())
            except OSError:
                pass
    except OSError:
        pass
    return names


def environ(pid):
    """The environment of ``pid`` (from /proc), {} when it cannot be read."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            items = fh.read().split(b"\0")
    except OSError:
        return {}
    out = {}
    for it in items:
        k, unused, v = it.partition(b"=")
        if k:
            out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return out


def _shm_maps(pid):
    try:
        with open("/proc/%d/maps" % pid) as fh:
            return [ln.split()[-1] for ln in fh if "/dev/shm/" in ln]
    except OSError:
        return []


def _mapped_files(pid):
    try:
        with open("/proc/%d/maps" % pid) as fh:
            return {ln.split()[-1] for ln in fh if "/" in ln}
    except OSError:
        return set()


def unified_cgroup(pid):
    """The cgroup v2 path of ``pid`` (the "0::" line of /proc/<pid>/cgroup), or None without one."""
    try:
        with open("/proc/%s/cgroup" % ("self" if pid == "self" else int(pid))) as fh:
            for line in fh:
                if line.startswith("0::"):
                    return line[3:].strip() or "/"
    except OSError:
        pass
    return None


def container_id(pid):
    """The 64-hex container id from /proc/<pid>/cgroup, when the process runs in a container."""
    try:
        with open("/proc/%d/cgroup" % pid) as fh:
            m = re.search(r"([0-9a-f]{64})", fh.read())
        return m.group(1) if m else None
    except OSError:
        return None


def wait_gone(pids, timeout=10.0):
    """Wait until no pid in pids exists (PID 1 of some VMs reaps orphans slowly). Returns those left
    (never raises: the caller decides what a pid still there means)."""
    left = list(pids)

    def gone():
        left[:] = [p for p in left if os.path.exists("/proc/%d" % p)]
        return not left

    wait_for(gone, timeout, "pids %s to be gone" % left, interval=0.05, on_timeout="return")
    return left


def file_locks(pids):
    """{pid: [lock lines]} of the file locks (POSIX, OFD, flock, leases) that ``pids`` hold, from
    /proc/<pid>/fdinfo (CRIU dumps them only with --file-locks)."""
    out = {}
    for pid in pids:
        try:
            fds = os.listdir("/proc/%d/fdinfo" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                with open("/proc/%d/fdinfo/%s" % (pid, fd)) as fh:
                    locks = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("lock:")]
            except OSError:
                continue
            if locks:
                out.setdefault(pid, []).extend(locks)
    return out


def fd_links(pid):
    """[(fd path, link)] of the files ``pid`` holds open, from /proc/<pid>/fd (an fd closed meanwhile is left out;
    none for a process gone or not ours to read)."""
    base = "/proc/%d/fd" % int(pid)
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    out = []
    for fd in fds:
        path = "%s/%s" % (base, fd)
        try:
            out.append((path, os.readlink(path)))
        except OSError:
            continue
    return out


def io_uring_users(pids):
    """The pids among ``pids`` that hold an io_uring (its ring mapped, or its fd open): CRIU cannot dump one
    ("Unknown ... anon_inode:[io_uring]"). libuv (1.45+) makes one by itself: PyTorch's TCPStore, torchrun's
    rendezvous, node."""
    out = []
    for pid in pids:
        try:
            with open("/proc/%d/maps" % pid) as fh:
                if any("anon_inode:[io_uring]" in ln for ln in fh):
                    out.append(pid)
                    continue
        except OSError:
            continue
        if any(link == "anon_inode:[io_uring]" for _path, link in fd_links(pid)):
            out.append(pid)
    return out


GHOST_LIMIT = 1 << 20  # CRIU's default --ghost-limit: the largest deleted file it dumps


# What /proc shows "(deleted)" that CRIU does not dump as a ghost file: shared anonymous memory ("/dev/zero"), memfds
# and System V segments, which CRIU dumps as shared memory or memfds whatever their size. Counting them would refuse a
# runtime that cannot raise CRIU's ghost limit (runc) for nothing. (A PyTorch process in a runc container on an H100
# was refused for a "deleted file" of 8.25 MiB; which file is not known yet: the refusal now names it.)
SHARED_ANONYMOUS = "/dev/zero"
NOT_GHOST_PREFIXES = ("/memfd:", "/SYSV")


def _is_ghost(name):
    """Whether a "(deleted)" name of /proc (a mapping's path or an fd's link) is a file CRIU dumps as a ghost file."""
    name = name[:-len(" (deleted)")] if name.endswith(" (deleted)") else name
    return not (name == SHARED_ANONYMOUS or name.startswith(NOT_GHOST_PREFIXES))


def deleted_files(pids):
    """The deleted (unlinked) regular files that ``pids`` map or hold open and that CRIU dumps into the image as
    "ghost files", refusing one over its --ghost-limit (NCCL's shared-memory transport maps unlinked
    /dev/shm/nccl-* segments of 34 MB, measured on 2 x H100): [(size, name)], largest first."""
    found = {}
    for pid in pids:
        try:
            with open("/proc/%d/maps" % pid) as fh:
                places = [("/proc/%d/map_files/%s" % (pid, ln.split()[0]), ln.split(None, 5)[-1].strip())
                          for ln in fh if ln.rstrip().endswith("(deleted)") and len(ln.split(None, 5)) == 6]
        except OSError:
            continue
        places.extend((path, link) for path, link in fd_links(pid) if link.endswith(" (deleted)"))
        for path, name in places:
            if not _is_ghost(name):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = (st.st_size, name[:-len(" (deleted)")])
    return sorted(found.values(), reverse=True)


def largest_deleted_file(pids):
    """The size of the largest file of ``deleted_files(pids)``, 0 when none."""
    files = deleted_files(pids)
    return files[0][0] if files else 0
