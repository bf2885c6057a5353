# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A CDI spec for this node's GPUs, made from the driver's own files, for where NVIDIA's toolkit (nvidia-ctk) is not
installed: what ``nvidia-ctk cdi generate`` writes, so that ``docker run --device nvidia.com/gpu=all`` (Docker 25+)
and ``podman run --device nvidia.com/gpu=0`` give a container its GPUs.

The spec (kind ``nvidia.com/gpu``) names each GPU twice, by its index (the driver's bus order, nvidia-smi's) and by
its UUID, plus ``all``; each of those adds the GPU's own node (``/dev/nvidia<minor>``). What every request adds
(``containerEdits`` of the spec): the driver's control nodes that this host has (nvidiactl, nvidia-uvm,
nvidia-uvm-tools, nvidia-modeset), the driver's user-space libraries bind-mounted read-only, its tools (nvidia-smi,
...), and the persistence daemon's socket.

No hook: nvidia-ctk's ``update-ldcache`` hook is nvidia-ctk itself. Instead each library is mounted both under its
file name and under its soname (``libcuda.so.1``) in one directory, the host's own by default
(``/usr/lib/x86_64-linux-gnu`` on Debian and Ubuntu, a directory that glibc's loader searches in Debian and Ubuntu
images without any cache entry), or ``lib_dir`` (``/usr/local/nvidia/lib64``, which the CUDA images' LD_LIBRARY_PATH
names). docs/cdi.md says what that leaves out.

``cdiVersion`` 0.5.0: the newest that Podman 4.3 (Debian 12) reads, and the first that allows a device name that
starts with a digit and ``hostPath`` on a device node.

Pure functions: ``gather`` reads the host into a listing, ``build_spec`` turns a listing into the spec, ``render``
writes it as YAML (a subset every YAML reader parses; no PyYAML needed on the node).
"""
from __future__ import annotations

import json
import os
import re

from ..core.run import run
from . import devices

CDI_VERSION = "0.5.0"
KIND = "nvidia.com/gpu"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# The driver's libraries for compute, management and video, by the name before ".so" (nvidia-ctk's compute,
# utility and video sets); graphics (EGL, GLX, Vulkan) is left out.
LIBRARIES = ("libcuda", "libcudadebugger", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm",
             "libnvidia-opencl", "libnvidia-cfg", "libnvidia-allocator", "libnvidia-gpucomp", "libnvidia-pkcs11",
             "libnvidia-pkcs11-openssl3", "libnvidia-opticalflow", "libnvcuvid", "libnvidia-encode")
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
# /usr/local/nvidia/bin: where GKE-style hosts (and the GPU machine this was tried on) keep the driver's tools, with a
# shell wrapper of the same name in /usr/bin that would be useless inside a container.
BIN_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin", "/usr/local/nvidia/bin")
CONTAINER_BIN_DIR = "/usr/bin"  # where a container finds the tools (on any image's PATH)
LDCONFIG = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
SOCKETS = ("/run/nvidia-persistenced/socket",)
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
# ldconfig -p's marks of a library of the machine's own word size (x86-64, arm64, ppc64le); the 32-bit copies of
# the same libraries carry none of them
NATIVE_MARKS = ("x86-64", "AArch64", "64bit")
LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")
VERSION_LINE = re.compile(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9]+(?:\.[0-9]+)+)")


def driver_version(proc_dir=None):
    """The loaded kernel module's version from the driver's ``version`` file ("550.54.15"), or None."""
    try:
        with open(os.path.join(proc_dir or devices.proc_dir(), "version")) as fh:
            match = VERSION_LINE.search(fh.read())
    except OSError:
        return None
    return match.group(1) if match else None


def parse_ldconfig(text):
    """``ldconfig -p``'s lines as [(soname, marks, path)]."""
    out = []
    for line in (text or "").splitlines():
        match = LDCONFIG_LINE.match(line)
        if match:
            out.append((match.group(1), match.group(2), match.group(3)))
    return out


def _library_stem(soname):
    stem, sep, rest = soname.partition(".so")
    return stem if sep and (rest == "" or rest.startswith(".")) else None


def driver_libraries(entries, version, realpath=os.path.realpath):
    """The driver's libraries among ``ldconfig -p``'s ``entries`` (parse_ldconfig): [{"soname", "path"}], ``path`` the
    file a soname resolves to. Only the machine's own word size, only files of the loaded driver's ``version``
    (``libcuda.so.550.54.15``; a library a former driver left behind is not this driver's), each soname once."""
    out, seen = [], set()
    for soname, marks, path in entries:
        if _library_stem(soname) not in LIBRARIES or soname in seen:
            continue
        if not any(mark in marks for mark in NATIVE_MARKS):
            continue
        real = realpath(path)
        if version and not os.path.basename(real).endswith(".so." + version):
            continue
        seen.add(soname)
        out.append({"soname": soname, "path": real})
    return out


def _present(path):
    """Whether a device node (or what a test puts there) stands at ``path``."""
    return os.path.exists(path) and not os.path.isdir(path)


def _is_elf(path):
    """Whether ``path`` is a program of its own (an ELF file), not a wrapper script that calls one elsewhere."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def _ldconfig_listing(ldconfig):
    for path in ([ldconfig] if ldconfig else LDCONFIG):
        if os.path.exists(path):
            return run([path, "-p"], timeout=60, check=False).stdout
    return ""


def gather(proc_dir=None, dev_dir="/dev", ldconfig=None, ldconfig_text=None, bin_dirs=None, sockets=None):
    """What the spec is made of, read from this host: {"driver_version", "gpus" (devices.inventory, in index
    order), "control_nodes" (the names of CONTROL_NODES present in ``dev_dir``), "missing_gpu_nodes",
    "libraries" (driver_libraries of ``ldconfig -p``, or of ``ldconfig_text`` when given), "binaries" (paths),
    "sockets" (paths)}. ``bin_dirs`` and ``sockets``: where to look instead of BIN_DIRS and SOCKETS."""
    proc_dir = proc_dir or devices.proc_dir()
    version = driver_version(proc_dir)
    gpus = devices.inventory(proc_dir)
    text = _ldconfig_listing(ldconfig) if ldconfig_text is None else ldconfig_text
    binaries = []
    for name in BINARIES:
        for folder in BIN_DIRS if bin_dirs is None else bin_dirs:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.access(path, os.X_OK) and _is_elf(path):
                binaries.append(path)
                break
    return {
        "driver_version": version,
        "gpus": gpus,
        "control_nodes": [n for n in CONTROL_NODES if _present(os.path.join(dev_dir, n))],
        "missing_gpu_nodes": ["nvidia%d" % g["minor"] for g in gpus
                              if not _present(os.path.join(dev_dir, "nvidia%d" % g["minor"]))],
        "libraries": driver_libraries(parse_ldconfig(text), version),
        "binaries": binaries,
        "sockets": [path for path in (SOCKETS if sockets is None else sockets) if os.path.exists(path)],
    }


def _node(name, dev_dir):
    node = {"path": "/dev/" + name}
    if os.path.normpath(dev_dir) != "/dev":
        node["hostPath"] = os.path.join(dev_dir, name)
    return node


def _mount(host_path, container_path, extra=()):
    return {"hostPath": host_path, "containerPath": container_path, "options": list(MOUNT_OPTIONS) + list(extra)}


def build_spec(listing, kind=KIND, dev_dir="/dev", lib_dir=None):
    """The CDI spec (a dict) for ``listing`` (gather's). ``dev_dir``: where the host's nodes are (the container's are
    under /dev whatever it is). ``lib_dir``: the container's directory for the libraries (default: each one's host
    directory)."""
    gpus = listing.get("gpus") or []
    gpu_nodes = [_node("nvidia%d" % g["minor"], dev_dir) for g in gpus]
    spec_devices = []
    for index, (gpu, node) in enumerate(zip(gpus, gpu_nodes)):
        spec_devices.append({"name": str(index), "containerEdits": {"deviceNodes": [node]}})
    for gpu, node in zip(gpus, gpu_nodes):
        spec_devices.append({"name": gpu["uuid"], "containerEdits": {"deviceNodes": [node]}})
    if gpus:
        spec_devices.append({"name": "all", "containerEdits": {"deviceNodes": gpu_nodes}})
    mounts, targets = [], set()
    for lib in listing.get("libraries") or []:
        folder = lib_dir or os.path.dirname(lib["path"])
        for name in sorted({os.path.basename(lib["path"]), lib["soname"]}):
            # two sonames of one file (libcuda.so.1, libcuda.so) mount that file's own name once
            if os.path.join(folder, name) not in targets:
                targets.add(os.path.join(folder, name))
                mounts.append(_mount(lib["path"], os.path.join(folder, name)))
    mounts.extend(_mount(path, os.path.join(CONTAINER_BIN_DIR, os.path.basename(path))) for path in listing.get("binaries") or [])
    mounts.extend(_mount(path, path, ("noexec",)) for path in listing.get("sockets") or [])
    edits = {
        # the NVIDIA runtime's hook, where one is also installed, must not add the GPUs a second time
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [_node(name, dev_dir) for name in listing.get("control_nodes") or []],
        "mounts": mounts,
    }
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": spec_devices,
            "containerEdits": {key: value for key, value in edits.items() if value}}


def device_names(spec):
    """The fully qualified names a container asks for ("nvidia.com/gpu=0", ...), in the spec's order."""
    return ["%s=%s" % (spec["kind"], d["name"]) for d in spec.get("devices") or []]


def _emit(value, indent, lines):
    pad = " " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append("%s%s:" % (pad, key))
                _emit(item, indent + 2, lines)
            else:
                # a JSON scalar is a YAML flow scalar: a string stays one ("0" is not read as a number)
                lines.append("%s%s: %s" % (pad, key, json.dumps(item)))
    else:
        for item in value:
            if isinstance(item, dict) and item:
                sub = []
                _emit(item, indent + 2, sub)
                lines.append(pad + "- " + sub[0].lstrip())
                lines.extend(sub[1:])
            elif isinstance(item, list) and item:
                lines.append(pad + "-")
                _emit(item, indent + 2, lines)
            else:
                lines.append(pad + "- " + json.dumps(item))


def render(spec, header=None):
    """``spec`` as YAML text: block style, every string double-quoted, keys in the spec's order. ``header``: comment
    lines put first."""
    lines = ["# " + line if line else "#" for line in (header or [])]
    _emit(spec, 0, lines)
    return "\n".join(lines) + "\n"
