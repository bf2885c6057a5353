# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A checkpoint's image kept in memory (``image_in_memory``): how big its tmpfs is, and whether this
host's RAM holds it, decided before anything is frozen (core/memdir.py mounts it).

The host must hold, on top of what runs now:
- the image itself, up to the tmpfs's size: the tree's host RSS plus its GPU memory, times the
  planner's margin, plus room for CRIU's other images;
- the GPU memory that stage 1 brings into the job's own host RAM (the driver copies it there before
  CRIU reads it), when the image's size was given and that memory is not known, the image's size;
- a reserve for everything else on the host (5 % of its RAM, at least 1 GiB).
A figure that cannot be read is unknown, never zero: the image is then refused in memory (nothing
frozen), unless its size is given (``image_memory_bytes``).
"""
from __future__ import annotations

import os

from ..core import memdir, procfs
from ..core.errors import InvalidTarget
from . import facts

GIB = 2**30
MARGIN = 1.10            # the migration planner's IMAGE_MARGIN: image bytes over host RSS + GPU memory
OTHER_IMAGES = 256 * 2**20  # CRIU's images besides the pages (fds, mm, core, ...), with room to spare
HINT = "leave image_in_memory off (the image goes to image_dir's disk), or free host memory"


def _gib(n):
    return "%.1f GiB" % (n / GIB)


def plan(pids, cuda_pids, size_bytes=None):
    """{"size_bytes", "rss_bytes", "gpu_bytes", "gpu_memory_source", "stage1_bytes", "reserve_bytes",
    "available_bytes", "tmpfs_huge" (memdir.huge_policy)}; raises InvalidTarget (nothing frozen) when the host cannot hold it or a figure it
    needs is unknown."""
    rss = sum(procfs.rss_bytes(p) for p in pids)
    gpu = facts.tree_gpu_memory(pids, {p: "running" for p in cuda_pids})
    gpu_bytes = gpu["gpu_bytes"]
    if size_bytes is None:
        if gpu_bytes is None:
            raise InvalidTarget("image_in_memory: the image's size is unknown, so its tmpfs cannot be sized: the "
                                "workload's GPU memory is unknown (%s); nothing was frozen"
                                % gpu["gpu_memory_unknown_reason"], stage="preflight",
                                hint="give image_memory_bytes (the image's size at most), or " + HINT)
        size_bytes = int((rss + gpu_bytes) * MARGIN) + OTHER_IMAGES
    size_bytes = int(size_bytes)
    try:
        huge = memdir.huge_policy()
    except ValueError as exc:
        raise InvalidTarget("image_in_memory: %s; nothing was frozen" % exc, stage="preflight")
    if size_bytes <= 0:
        raise InvalidTarget("image_memory_bytes must be positive, got %s" % size_bytes, stage="preflight")
    # Whatever of the tree holds GPU memory brings it into host RAM in stage 1, also where the runtime runs
    # that stage itself (its CUDA pids are not the engine's); unknown counts as the whole image.
    stage1 = gpu_bytes if gpu_bytes is not None else size_bytes
    mem = procfs.meminfo()
    total, avail = mem["total_bytes"], mem["available_bytes"]
    out = {"size_bytes": size_bytes, "rss_bytes": rss, "gpu_bytes": gpu_bytes,
           "gpu_memory_source": gpu["gpu_memory_source"], "stage1_bytes": stage1, "available_bytes": avail,
           "tmpfs_huge": huge}
    if avail is None or total is None:
        raise InvalidTarget("image_in_memory: this host's free memory is unknown (/proc/meminfo has no MemAvailable); "
                            "nothing was frozen", stage="preflight", hint=HINT, details=out)
    out["reserve_bytes"] = reserve = memdir.reserve_bytes(total)
    if avail < size_bytes + stage1 + reserve:
        raise InvalidTarget("image_in_memory: this host has %s available; it needs %s for the image in memory, %s for "
                            "the GPU memory stage 1 brings into host RAM and %s in reserve; nothing was frozen"
                            % (_gib(avail), _gib(size_bytes), _gib(stage1), _gib(reserve)),
                            stage="preflight", hint=HINT, details=out)
    return out


# The target's tmpfs is sized before the source's checkpoint measured anything: from the preflight's estimate,
# with room for an image a little bigger (a tmpfs's size is a cap, not memory taken).
TARGET_HEADROOM = 1.2


def target_plan(expected_bytes):
    """A migration's target keeping its image in memory (gpu_migration begin's ``image_in_memory``): the tmpfs's
    size for an image of about ``expected_bytes``, and whether this host's RAM holds, on top of what runs now, the
    image, the restore's copy of the job's memory (CRIU brings its pages into host RAM before the driver moves the
    GPU's part back) and the reserve. Returns {"size_bytes", "expected_bytes", "available_bytes", "reserve_bytes",
    "tmpfs_huge"}; raises InvalidTarget, before anything is made or frozen, when it does not fit or is unknown."""
    hint = "leave gpuckpt_target_image_in_memory off (the image lands on the target's disk), or free host memory"
    try:
        expected = int(expected_bytes)
    except (TypeError, ValueError):
        expected = 0
    if expected <= 0:
        raise InvalidTarget("image_in_memory on the target: the image's size is unknown (image_memory_bytes %r), so its "
                            "tmpfs cannot be sized; nothing was frozen" % (expected_bytes,), stage="preflight",
                            hint="give gpuckpt_image_memory_bytes, or " + hint)
    try:
        huge = memdir.huge_policy()
    except ValueError as exc:
        raise InvalidTarget("image_in_memory: %s; nothing was frozen" % exc, stage="preflight")
    mem = procfs.meminfo()
    total, avail = mem["total_bytes"], mem["available_bytes"]
    out = {"size_bytes": int(expected * TARGET_HEADROOM) + OTHER_IMAGES, "expected_bytes": expected,
           "available_bytes": avail, "tmpfs_huge": huge}
    if avail is None or total is None:
        raise InvalidTarget("image_in_memory on the target: this host's free memory is unknown (/proc/meminfo has no "
                            "MemAvailable); nothing was frozen", stage="preflight", hint=hint, details=out)
    out["reserve_bytes"] = reserve = memdir.reserve_bytes(total)
    if avail < 2 * expected + reserve:
        raise InvalidTarget("image_in_memory on the target: this host has %s available; it needs %s for the image in "
                            "memory, %s for the restored job's memory and %s in reserve; nothing was frozen"
                            % (_gib(avail), _gib(expected), _gib(expected), _gib(reserve)),
                            stage="preflight", hint=hint, details=out)
    return out


def mount(image_dir, made, size_bytes, huge=None):
    """Mount the image's tmpfs on the directory prepare_dir just made; ``made``'s identity becomes the
    tmpfs root's (every later removal finds, and unmounts, it by that identity). On failure the directory
    is removed and InvalidTarget raised: nothing was frozen. ``huge``: the tmpfs's huge= policy (plan's)."""
    try:
        made["identity"] = memdir.mount_image_dir(image_dir, size_bytes, huge)
    except OSError as exc:
        try:
            os.rmdir(image_dir)
        except OSError:
            pass
        raise InvalidTarget("image_in_memory: %s; nothing was frozen" % exc.strerror, stage="preflight",
                            hint="run as root (mounting a tmpfs needs CAP_SYS_ADMIN), or " + HINT)
    made["in_memory"] = True
    return made


def explain_full(exc, image_dir, memory):
    """A dump that failed with the image's tmpfs (nearly) full: say so in the error, whose runtime
    message (CRIU's rc) does not."""
    if memory is None:
        return
    try:
        use = memdir.usage(image_dir)
    except OSError:
        return
    if use["size_bytes"] - use["used_bytes"] < 2**20:
        exc.msg += ("; the image's tmpfs is full (%s): the image outgrew its estimate" % _gib(use["size_bytes"]))
        exc.hint = "give a larger image_memory_bytes, or " + HINT
