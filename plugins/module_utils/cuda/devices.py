# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which GPUs a container holds, and how its processes are put back onto the GPUs of another container.

The driver restores a CUDA process onto the GPUs it was checkpointed on, by their place, unless it is given
a map of GPU UUIDs (old -> new) that names every GPU the process had (driver 580+). A pod restored on
another node, or onto other GPUs of its node, gets the GPUs the device plugin gives its new container: a
container's GPUs are matched by their place in it (its first GPU onto the new container's first GPU, ...),
so that ``cuda:0`` in the job is ``cuda:0`` again, on the GPU the new container owns.

A container's GPUs are read from its OCI spec, as the runtime builds them: the NVIDIA device nodes in
``linux.devices`` (major 195; what CDI and the device plugin's CDI mode put there), else the
``NVIDIA_VISIBLE_DEVICES`` the NVIDIA container runtime reads (UUIDs or indices). A GPU's UUID is found
from its device minor in the driver's ``/proc/driver/nvidia/gpus/*/information`` (``GPU UUID``,
``Device Minor``, ``Bus Location``); ``$GPUCKPT_NVIDIA_PROC`` names another place for that directory
(a node agent in a container that sees the host's /proc elsewhere).

A restored container's /dev is the one its checkpoint recorded: CRIU restores the container's /dev
(a tmpfs) with the device nodes the *source* container had, and the new spec's device nodes are not made
(measured with runc 1.1.5 and CRIU 4.2.1: a container checkpointed with /dev/nvidia0 and restored into a
spec that lists /dev/nvidia1 had /dev/nvidia0 and no /dev/nvidia1). The driver's restore opens the new
GPU's node from inside the process, so ``sync_device_nodes`` makes the /dev of the restored container
match its new spec before the GPU memory is restored: the nodes the spec lists made (the new GPUs, and the
control nodes, whose majors differ between nodes), the old GPUs' nodes that the new container does not own
removed (the device cgroup denies them anyway; a node for another tenant's GPU has no business there).
"""
from __future__ import annotations

import os
import re
import stat

from ..core.errors import GpuCkptError, InvalidTarget

NVIDIA_MAJOR = 195
# minors 254 (nvidia-modeset) and 255 (nvidiactl) are the driver's control nodes, not GPUs
FIRST_CONTROL_MINOR = 254
DEFAULT_PROC = "/proc/driver/nvidia"
GPU_NODE = re.compile(r"^nvidia([0-9]+)\Z")


def proc_dir():
    return os.environ.get("GPUCKPT_NVIDIA_PROC") or DEFAULT_PROC


def inventory(root=None):
    """This host's GPUs as the driver lists them: [{"uuid", "minor", "bus"}], in bus order (the NVIDIA
    container runtime's and nvidia-smi's index order). [] without the driver."""
    base = os.path.join(root or proc_dir(), "gpus")
    out = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    for name in names:
        fields = {}
        try:
            with open(os.path.join(base, name, "information")) as fh:
                for line in fh:
                    key, sep, value = line.partition(":")
                    if sep:
                        fields[key.strip()] = value.strip()
        except OSError:
            continue
        try:
            minor = int(fields.get("Device Minor", ""))
        except ValueError:
            continue
        uuid = fields.get("GPU UUID", "")
        if uuid:
            out.append({"uuid": uuid, "minor": minor, "bus": fields.get("Bus Location") or name})
    out.sort(key=lambda g: g["bus"].lower())
    return out


def _gpu_minor(entry):
    """The GPU minor of an OCI ``linux.devices`` entry, or None (not an NVIDIA GPU node)."""
    try:
        if entry.get("type", "c") != "c" or int(entry.get("major", -1)) != NVIDIA_MAJOR:
            return None
        minor = int(entry.get("minor", -1))
    except (TypeError, ValueError):
        return None
    return minor if 0 <= minor < FIRST_CONTROL_MINOR else None


def spec_gpus(spec, inv=None):
    """The GPUs an OCI spec gives its container, in their order inside it (by device minor, as the
    driver enumerates them): [{"uuid", "minor", "path"}]. ``uuid`` is None for a minor this host's
    driver does not list."""
    inv = inventory() if inv is None else inv
    by_minor = {g["minor"]: g for g in inv}
    found = {}
    for entry in ((spec or {}).get("linux") or {}).get("devices") or []:
        minor = _gpu_minor(entry)
        if minor is not None and minor not in found:
            found[minor] = {"uuid": (by_minor.get(minor) or {}).get("uuid"), "minor": minor,
                            "path": entry.get("path") or "/dev/nvidia%d" % minor}
    if not found:
        for g in _visible_devices(spec, inv):
            found[g["minor"]] = {"uuid": g["uuid"], "minor": g["minor"], "path": "/dev/nvidia%d" % g["minor"]}
    return [found[m] for m in sorted(found)]


def _visible_devices(spec, inv):
    """The GPUs that NVIDIA_VISIBLE_DEVICES in the spec's environment names (the NVIDIA container runtime's
    legacy mode): "all", a list of UUIDs, or indices into the driver's bus order."""
    value = None
    for item in ((spec or {}).get("process") or {}).get("env") or []:
        key, sep, val = str(item).partition("=")
        if sep and key == "NVIDIA_VISIBLE_DEVICES":
            value = val.strip()
    if not value or value in ("void", "none"):
        return []
    if value == "all":
        return list(inv)
    by_uuid = {g["uuid"]: g for g in inv}
    out = []
    for word in value.split(","):
        word = word.strip()
        if word.isdigit() and int(word) < len(inv):
            out.append(inv[int(word)])
        elif word in by_uuid:
            out.append(by_uuid[word])
    return out


def process_gpus(pid, inv=None):
    """The GPUs a (running, not yet checkpointed) CUDA process holds open, by its device files' numbers
    (those of the host, whatever the names inside a container): [{"uuid", "minor"}] by minor."""
    inv = inventory() if inv is None else inv
    by_minor = {g["minor"]: g["uuid"] for g in inv}
    minors = set()
    base = "/proc/%d/fd" % int(pid)
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    for fd in fds:
        try:
            st = os.stat(os.path.join(base, fd))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR and \
                os.minor(st.st_rdev) < FIRST_CONTROL_MINOR:
            minors.add(os.minor(st.st_rdev))
    return [{"uuid": by_minor.get(m), "minor": m} for m in sorted(minors)]


def placement_pairs(old, new, what):
    """The driver's (old UUID, new UUID) pairs that put a container's GPUs ``old`` onto ``new`` place by
    place; None when they are the same GPUs (the driver's own default). Refused when the counts differ
    or a UUID is unknown: the driver's map is one to one, and a wrong guess would put a job on a GPU its
    container does not own."""
    if len(old) != len(new):
        raise InvalidTarget("%s held %d GPU(s) when it was checkpointed and is given %d here; the driver restores "
                            "each GPU of a checkpoint onto exactly one GPU" % (what, len(old), len(new)),
                            stage="cuda-restore", hint="give the new container as many GPUs as the old one had")
    if any(not g.get("uuid") for g in old) and [g.get("minor") for g in old] == [g.get("minor") for g in new]:
        return None  # which GPUs it had was not known at the checkpoint: the same places, the driver's own default
    unknown = [g for g in list(old) + list(new) if not g.get("uuid")]
    if unknown:
        raise InvalidTarget("%s: the GPU of device minor %s is not one this node's driver lists (%s/gpus)"
                            % (what, unknown[0].get("minor"), proc_dir()), stage="cuda-restore",
                            hint="the GPU's UUID is read from the driver's information files")
    pairs = [(o["uuid"], n["uuid"]) for o, n in zip(old, new)]
    return None if all(a == b for a, b in pairs) else pairs


def spec_device_nodes(spec):
    """The device nodes an OCI spec lists directly under /dev ({name: (S_IFCHR|S_IFBLK, major, minor, mode)}): what
    the restored container's /dev must hold. Besides the GPUs, the NVIDIA control nodes, whose majors differ
    from node to node (nvidia-uvm's is given by the kernel when the module loads)."""
    out = {}
    for entry in ((spec or {}).get("linux") or {}).get("devices") or []:
        path = str(entry.get("path") or "")
        name = os.path.basename(path)
        kind = {"c": stat.S_IFCHR, "u": stat.S_IFCHR, "b": stat.S_IFBLK}.get(entry.get("type"))
        if os.path.dirname(path) != "/dev" or not name or name.startswith(".") or kind is None:
            continue
        try:
            major, minor = int(entry.get("major")), int(entry.get("minor"))
            mode = int(entry.get("fileMode") or 0o666) & 0o777
        except (TypeError, ValueError):
            continue
        out[name] = (kind, major, minor, mode)
    return out


def sync_device_nodes(pid, spec):
    """Make the /dev of the container that ``pid`` runs in hold the device nodes its new OCI ``spec`` lists
    (spec_device_nodes): each made where it is missing or is something else (another device, a file, a link),
    and every GPU node (nvidia<N> of major 195) that the spec does not list removed. Returns {"made": [...],
    "removed": [...]}.

    The container's /dev is reached through ``/proc/<pid>/root`` (its root, in its own mount namespace: the
    walk follows that namespace's mounts), opened without following a link at ``dev``, and changed only by
    names inside it that are never followed: nothing in the container (a symlink planted at /dev or at a
    node's name) can point it at the host. (Joining the container's mount namespace instead was refused with
    EINVAL for a container restored by runc restore on an H100 machine's kernel 6.18.)"""
    try:
        dev = os.open("/proc/%d/root/dev" % int(pid), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise GpuCkptError("could not set the GPU device nodes of the restored container of pid %d: its /dev: %s"
                           % (pid, exc.strerror), stage="cuda-restore", pid=pid,
                           hint="the container's /dev must be a directory (a tmpfs, as runtimes make it), not a link")
    try:
        return _sync_nodes(dev, spec_device_nodes(spec))
    except OSError as exc:
        raise GpuCkptError("could not set the GPU device nodes of the restored container of pid %d: %s"
                           % (pid, exc), stage="cuda-restore", pid=pid)
    finally:
        os.close(dev)


def _sync_nodes(dev, want):
    """In the container's /dev (the directory fd ``dev``): the nodes ``want`` made, stray GPU nodes removed."""
    made, removed = [], []
    for name in sorted(os.listdir(dev)):
        if not GPU_NODE.match(name) or name in want:
            continue
        st = os.stat(name, dir_fd=dev, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR:
            os.unlink(name, dir_fd=dev)
            removed.append("/dev/" + name)
    for name, (kind, major, minor, mode) in sorted(want.items()):
        rdev = os.makedev(major, minor)
        try:
            st = os.stat(name, dir_fd=dev, follow_symlinks=False)
            if stat.S_IFMT(st.st_mode) == kind and st.st_rdev == rdev:
                continue
            if stat.S_ISDIR(st.st_mode):
                raise OSError("/dev/%s is a directory where the spec lists a device" % name)
            os.unlink(name, dir_fd=dev)  # a regular file, a symlink, another device: not this one
        except FileNotFoundError:
            pass
        os.mknod(name, mode | kind, rdev, dir_fd=dev)
        # its mode past the umask, on the node made and on nothing else: the job runs meanwhile and could put a
        # link to a host file in its place; a path fd opened without following, checked, then changed
        node = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dev)
        try:
            st = os.fstat(node)
            if stat.S_IFMT(st.st_mode) != kind or st.st_rdev != rdev:
                raise OSError("/dev/%s was replaced while it was made" % name)
            os.chmod("/proc/self/fd/%d" % node, mode)
        finally:
            os.close(node)
        made.append("/dev/" + name)
    return {"made": made, "removed": removed}


def _is_gpu_path(path):
    return bool(GPU_NODE.match(os.path.basename(str(path or ""))))


def lists_nvidia_devices(spec):
    """Whether an OCI spec gives its container NVIDIA device nodes (the GPUs or the driver's control nodes)."""
    return any(os.path.basename(str(e.get("path") or "")).startswith("nvidia")
               for e in ((spec or {}).get("linux") or {}).get("devices") or [])


def stale_spec_devices(spec, host_root="/"):
    """The NVIDIA ``linux.devices`` entries of an OCI spec whose path is, on this host, a device of the same
    kind with other numbers: [(entry, host major, host minor)]. A spec made on another node names that node's
    numbers (nvidia-uvm's and nvidia-caps' majors are given by the kernel when the module loads), and the
    container runtime builds the device cgroup from them. A GPU node (nvidia<N>) the host lacks is refused:
    that GPU is not here. Only the driver's nodes are looked at: their path in the container is their path on
    the host (the driver opens them by the minors it lists), while another device may be given to a container
    under another name (``--device /dev/sdc:/dev/xvdc``), where the host's node of that name is not it."""
    out = []
    minors = None
    for entry in ((spec or {}).get("linux") or {}).get("devices") or []:
        path = str(entry.get("path") or "")
        kind = {"c": stat.S_IFCHR, "u": stat.S_IFCHR, "b": stat.S_IFBLK}.get(entry.get("type"))
        if not path.startswith("/dev/") or not os.path.basename(path).startswith("nvidia") or kind is None:
            continue
        if _is_gpu_path(path):
            minors = {g["minor"] for g in inventory()} if minors is None else minors
            if minors and _gpu_minor(entry) not in minors:
                raise InvalidTarget("the container's spec gives it %s (minor %s), a GPU this host's driver does not "
                                    "list; nothing was restored" % (path, entry.get("minor")), stage="preflight",
                                    hint="restore onto a host with as many GPUs, or give the container a spec made "
                                         "for this host")
        try:
            st = os.stat(os.path.join(host_root, path.lstrip("/")))
        except OSError:
            continue  # no node here (nvidia-modprobe makes them on first use): the runtime makes it as the spec says
        if stat.S_IFMT(st.st_mode) != kind:
            continue
        try:
            same = (int(entry.get("major")), int(entry.get("minor"))) == (os.major(st.st_rdev), os.minor(st.st_rdev))
        except (TypeError, ValueError):
            same = False
        if not same:
            out.append((entry, os.major(st.st_rdev), os.minor(st.st_rdev)))
    return out


def retarget_spec_devices(spec, host_root="/"):
    """Give an OCI spec recorded on another host this host's NVIDIA device numbers, by path, as the runtime would
    have resolved them had the container been created here: each stale ``linux.devices`` entry (stale_spec_devices)
    and the device-cgroup rules (``linux.resources.devices``) that allowed its old numbers. Changes ``spec``;
    returns ["path old -> new", ...] (empty: nothing differed)."""
    stale = stale_spec_devices(spec, host_root)
    rules = (((spec or {}).get("linux") or {}).get("resources") or {}).get("devices") or []
    # every rule mapped from its old numbers at once: one entry's new numbers may be another's old ones
    moved = {}
    for entry, major, minor in stale:
        moved[(_rule_type(entry.get("type")), str(entry.get("major")), str(entry.get("minor")))] = (major, minor)
    for rule in rules:
        key = (rule.get("type"), str(rule.get("major")), str(rule.get("minor")))
        if key in moved:
            rule["major"], rule["minor"] = moved[key]
    changed = []
    for entry, major, minor in stale:
        changed.append("%s %s:%s -> %d:%d" % (entry.get("path"), entry.get("major"), entry.get("minor"), major, minor))
        entry["major"], entry["minor"] = major, minor
    return changed


def _rule_type(entry_type):
    """The device-cgroup rule type of a ``linux.devices`` type ("u", unbuffered, is a character device)."""
    return "b" if entry_type == "b" else "c"
