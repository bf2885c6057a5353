# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A process's use of the GPU as /proc shows it: its open NVIDIA device files, and what the driver
cannot checkpoint (NCCL, CUDA IPC)."""
from __future__ import annotations

import os

from ..core.procfs import (
    _mapped_files, _shm_maps, _thread_names, cmdline, container_id, environ, fd_links, read_stat)


def nvidia_fds(pid):
    """Device files under /dev/nvidia* that pid holds open."""
    return sorted({link for _path, link in fd_links(pid) if link.startswith("/dev/nvidia")})


def shm_maps(pid):
    """The /dev/shm files ``pid`` maps."""
    return _shm_maps(pid)


NCCL_FEATURE = "NCCL (a distributed job's communicators)"
IPC_FEATURE = "CUDA IPC memory"


def unsupported_features(pid, env=None):
    """What the driver's checkpoint API cannot undo, detectable before freezing (driver 580.159.04,
    measured on the GPU machine, docs/benchmarks):
    - NCCL: the ranks checkpoint, but their restore fails (CUDA_ERROR_NOT_SUPPORTED) and they stay
      frozen. Every PyTorch process maps libnccl, so that alone says nothing; live communicators show
      as NCCL's shared memory (/dev/shm/nccl-*) or NCCL-named threads, and launchers (torchrun,
      DeepSpeed, accelerate) start each rank with WORLD_SIZE > 1 in its environment. A 2-rank NVLink
      job started without a launcher showed none of these: that case is not caught here.
    - CUDA IPC memory: producer and consumer map CUDA's /dev/shm/cuda.shm.* segment (no other CUDA
      process did); the consumer's restore fails (CUDA_ERROR_INVALID_VALUE) and it stays frozen.
    An NCCL job started with the environment that makes NCCL use transports the driver restores is
    checkpointable all the same: nccl.py decides that, for all its ranks together."""
    found = []
    shm = _shm_maps(pid)
    env = environ(pid) if env is None else env
    nccl_loaded = any("libnccl" in os.path.basename(p) for p in _mapped_files(pid))
    try:
        world = int(env.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    if any("/dev/shm/nccl-" in m for m in shm) or any(n.startswith("NCCL") for n in _thread_names(pid)) or (
            nccl_loaded and world > 1):
        found.append(NCCL_FEATURE)
    if any(os.path.basename(m).startswith("cuda.shm.") for m in shm):
        found.append(IPC_FEATURE)
    return found


def process_info(pid, driver=None):
    st = read_stat(pid) or {}
    info = {"pid": pid, "comm": st.get("comm"), "cmdline": cmdline(pid), "ppid": st.get("ppid"),
            "nvidia_devices": nvidia_fds(pid), "container_id": container_id(pid)}
    if driver is not None:
        info["cuda_state"] = driver.state_or_error(pid)
    return info
