# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether the driver can restore a distributed (NCCL) job, decided before anything is frozen (issue 45).

Measured on 2 x H100 80GB (driver 580.159.04, PyTorch 2.11.0+cu130, NCCL 2.28.9, NCCL_NVLS_ENABLE=0), a
deterministic 2-rank DDP job under torchrun, both ranks locked, checkpointed, restored and unlocked in place:

  NCCL's defaults (P2P over NVLink through cuMem)     restore CUDA_ERROR_NOT_SUPPORTED: frozen for good
  NCCL_CUMEM_ENABLE=0 (P2P through legacy CUDA IPC)   restore CUDA_ERROR_INVALID_VALUE: frozen for good
  NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0
  NCCL_CUMEM_HOST_ENABLE=0 (shared-memory transport)  restored; 300 of 300 losses identical on both ranks
  the same and NCCL_SHM_DISABLE=1 (sockets)           restored; 300 of 300 identical

So a job is checkpointable by configuration when every rank was started with ``RESTORABLE_ENV`` (NVLink SHARP
too off: its multicast objects are the driver's, never restored) and no rank maps CUDA IPC memory. Its cost: the
all-reduce bus bandwidth of 256 MiB fell from 255.9 GB/s (NCCL's defaults) to 19.7 GB/s (shared memory) and
2.4 GB/s (sockets) on that machine. Every other NCCL job is refused before anything is frozen, with what would make
it checkpointable.

What is read, per process of the tree, from /proc alone (no driver call): whether it is a live NCCL rank (its
shared memory /dev/shm/nccl-*, NCCL's threads, or libnccl mapped with WORLD_SIZE > 1: processes.py), its
environment's NCCL_* settings, and whether it maps CUDA IPC memory (/dev/shm/cuda.shm.*). A rank started without
a launcher over NVLink shows none of the first signs (processes.py): that case is not caught.
"""
from __future__ import annotations

from ..core import procfs
from . import processes as gpu_procs

# Each setting as a rank's environment must give it for the driver to restore its communicators.
RESTORABLE_ENV = (("NCCL_P2P_DISABLE", "1"), ("NCCL_CUMEM_ENABLE", "0"), ("NCCL_CUMEM_HOST_ENABLE", "0"),
                  ("NCCL_NVLS_ENABLE", "0"))
HOW = " ".join("%s=%s" % kv for kv in RESTORABLE_ENV)
COST = ("NCCL's transport between ranks becomes shared memory: measured on 2 x H100, the all-reduce bus bandwidth "
        "of 256 MiB fell from 255.9 GB/s to 19.7 GB/s")


def _set_as(env, key, want):
    """Whether NCCL reads ``key`` as ``want`` (NCCL takes an integer: "01" is 1, "" is unset)."""
    value = (env.get(key) or "").strip()
    try:
        return value != "" and int(value) == int(want)
    except ValueError:
        return False


def rank(pid):
    """What /proc shows of process ``pid`` as an NCCL rank: {"pid", "nccl" (a live rank), "cuda_ipc", "missing"
    (the RESTORABLE_ENV settings its environment lacks), "rank", "world_size"}."""
    env = procfs.environ(pid)
    features = gpu_procs.unsupported_features(pid, env=env)
    return {"pid": pid, "nccl": gpu_procs.NCCL_FEATURE in features, "cuda_ipc": gpu_procs.IPC_FEATURE in features,
            "missing": ["%s=%s" % (k, v) for k, v in RESTORABLE_ENV if not _set_as(env, k, v)],
            "rank": env.get("RANK"), "world_size": env.get("WORLD_SIZE")}


COOPERATIVE = ("or keep NCCL's defaults and checkpoint it cooperatively: the job imports tools/gpuckpt_quiesce.py "
               "(Cooperative().step_boundary(step), docs/multi_gpu.md) and the checkpoint is asked with quiesce_mode: "
               "cooperative, so its ranks release their communicators at a step boundary first (full speed between "
               "checkpoints)")


def judge(pids, cooperative=False):
    """The verdict on the tree ``pids`` (its CUDA processes, or all of it): {"distributed" (any live NCCL rank),
    "restorable" (the driver can restore every rank: each started with RESTORABLE_ENV, none with CUDA IPC
    memory), "ranks" (rank() of each NCCL rank), "refusal" (why not, naming the rank and both ways to make it
    checkpointable; None when restorable or not distributed)}. ``cooperative``: the ranks will be asked to release
    their communicators before the freeze (engine/cooperative.py), so their NCCL settings do not matter (CUDA IPC
    memory still does)."""
    ranks = [r for r in (rank(p) for p in pids) if r["nccl"]]
    out = {"distributed": bool(ranks), "restorable": False, "ranks": ranks, "refusal": None}
    if not ranks:
        return out
    for r in ranks:
        if r["cuda_ipc"]:
            return dict(out, refusal="pid %d (rank %s) maps CUDA IPC memory, which the driver cannot restore (its "
                                     "restore fails with CUDA_ERROR_INVALID_VALUE and the job stays frozen)"
                                     % (r["pid"], r["rank"] or "?"))
    lacking = [r for r in ranks if r["missing"]]
    if lacking and not cooperative:
        r = lacking[0]
        return dict(out, refusal=(
            "pid %d (rank %s of %s) is an NCCL rank started without %s: the driver checkpoints such a job but cannot "
            "restore its communicators (NCCL's NVLink/cuMem and CUDA IPC transports), so it would stay frozen. To "
            "make the job checkpointable, either start every rank with %s (%s), %s"
            % (r["pid"], r["rank"] or "?", r["world_size"] or "?", " ".join(r["missing"]), HOW, COST, COOPERATIVE)))
    return dict(out, restorable=True, cooperative=bool(cooperative and lacking))


def live_communicators(pid):
    """Whether ``pid`` still shows live NCCL communicators after it said it released them: NCCL's shared memory
    (/dev/shm/nccl-*) mapped. (libnccl stays mapped and WORLD_SIZE stays set: those say nothing here.)"""
    return any("/dev/shm/nccl-" in m for m in gpu_procs.shm_maps(pid))
