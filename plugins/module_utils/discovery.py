# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Processes on this host: validation of targets, process trees, CUDA processes, GPUs.

A process is a CUDA process when the driver reports a checkpoint state for it. Open /dev/nvidia*
fds are only a hint: a checkpointed process holds none, and the driver is the authority.
"""
from __future__ import annotations

import os
import re
import time

from .errors import InvalidTarget
from .run import find_binary, run

PF_KTHREAD = 0x00200000


def read_stat(pid):
    """Fields of /proc/<pid>/stat that we use, or None when the pid does not exist."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
    except (OSError, ValueError):
        return None
    comm = data[data.index("(") + 1:data.rindex(")")]
    rest = data[data.rindex(")") + 2:].split()
    return {"pid": pid, "comm": comm, "state": rest[0], "ppid": int(rest[1]), "pgrp": int(rest[2]),
            "session": int(rest[3]), "tty_nr": int(rest[4]), "flags": int(rest[6]), "starttime": int(rest[19])}


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


def _socket_inodes(pids):
    out = set()
    for pid in pids:
        try:
            names = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in names:
            try:
                link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    return out


def _hex_port(addr):
    return int(addr.rsplit(":", 1)[1], 16)


def bound_sockets(pids):
    """The addresses that the processes ``pids`` hold bound in their network namespace: listening
    TCP ports, bound UDP ports and abstract unix socket names (e.g. "tcp port 8000", "unix @x").
    A second copy of the workload restored in the SAME network namespace (one kernel seen as two
    hosts, host networking) cannot bind them again while the first copy is held stopped."""
    pids = [int(p) for p in pids or []]
    inodes = _socket_inodes(pids)
    if not inodes:
        return []
    out = set()
    net = "/proc/%d/net/" % pids[0]  # the workload's own view of its network namespace
    for name, listen_only in (("tcp", True), ("tcp6", True), ("udp", False), ("udp6", False)):
        try:
            with open(net + name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[9] in inodes and (f[3] == "0A" if listen_only else _hex_port(f[1]) != 0):
                        out.add("%s port %d" % (name.rstrip("6"), _hex_port(f[1])))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    try:
        with open(net + "unix") as fh:
            next(fh)
            for line in fh:
                f = line.split()
                if len(f) > 7 and f[6] in inodes and f[7].startswith("@"):
                    out.add("unix %s" % f[7])
    except (OSError, StopIteration):
        pass
    return sorted(out)


def net_namespace(pid="self"):
    try:
        return os.readlink("/proc/%s/ns/net" % pid)
    except OSError:
        return None


def _ancestors(pid):
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
    if st["flags"] & PF_KTHREAD or st["ppid"] == 2 or pid == 2:
        raise InvalidTarget("pid %d (%s) is a kernel thread; only user processes can be checkpointed"
                            % (pid, st["comm"]), stage="preflight", pid=pid)
    if st["state"] in ("Z", "X"):
        raise InvalidTarget("pid %d (%s) is a zombie: it has already exited" % (pid, st["comm"]),
                            stage="preflight", pid=pid)
    if pid in _ancestors(os.getpid()):
        raise InvalidTarget("pid %d is this tool's own process or one of its parents" % pid,
                            stage="preflight", pid=pid)
    return st


def nvidia_fds(pid):
    """Device files under /dev/nvidia* that pid holds open."""
    out = set()
    try:
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                out.add(target)
    except OSError:
        pass
    return sorted(out)


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


def _environ(pid):
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


def unsupported_features(pid):
    """What the driver's checkpoint API cannot undo, detectable before freezing (driver 580.159.04,
    measured on the GPU machine, docs/benchmarks):
    - NCCL: the ranks checkpoint, but their restore fails (CUDA_ERROR_NOT_SUPPORTED) and they stay
      frozen. Every PyTorch process maps libnccl, so that alone says nothing; live communicators show
      as NCCL's shared memory (/dev/shm/nccl-*) or NCCL-named threads, and launchers (torchrun,
      DeepSpeed, accelerate) start each rank with WORLD_SIZE > 1 in its environment. A 2-rank NVLink
      job started without a launcher showed none of these: that case is not caught here.
    - CUDA IPC memory: producer and consumer map CUDA's /dev/shm/cuda.shm.* segment (no other CUDA
      process did); the consumer's restore fails (CUDA_ERROR_INVALID_VALUE) and it stays frozen."""
    found = []
    shm = _shm_maps(pid)
    env = _environ(pid)
    nccl_loaded = any("libnccl" in os.path.basename(p) for p in _mapped_files(pid))
    try:
        world = int(env.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    if any("/dev/shm/nccl-" in m for m in shm) or any(n.startswith("NCCL") for n in _thread_names(pid)) or (
            nccl_loaded and world > 1):
        found.append("NCCL (a distributed job's communicators)")
    if any(os.path.basename(m).startswith("cuda.shm.") for m in shm):
        found.append("CUDA IPC memory")
    return found


def _mapped_files(pid):
    try:
        with open("/proc/%d/maps" % pid) as fh:
            return {ln.split()[-1] for ln in fh if "/" in ln}
    except OSError:
        return set()


def container_id(pid):
    """The 64-hex container id from /proc/<pid>/cgroup, when the process runs in a container."""
    try:
        with open("/proc/%d/cgroup" % pid) as fh:
            m = re.search(r"([0-9a-f]{64})", fh.read())
        return m.group(1) if m else None
    except OSError:
        return None


def ns_pids(pid):
    """NSpid line: the pid as seen in each nested pid namespace (host first)."""
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return [pid]


def wait_gone(pids, timeout=10.0):
    """Wait until no pid in pids exists (PID 1 of some VMs reaps orphans slowly). Returns those left."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if os.path.exists("/proc/%d" % p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if os.path.exists("/proc/%d" % p)]
    return left


def process_info(pid, driver=None):
    st = read_stat(pid) or {}
    info = {"pid": pid, "comm": st.get("comm"), "cmdline": cmdline(pid), "ppid": st.get("ppid"),
            "nvidia_devices": nvidia_fds(pid), "container_id": container_id(pid)}
    if driver is not None:
        info["cuda_state"] = driver.state_or_error(pid)
    return info


def gpus():
    """GPUs of this host through NVML (nvidia-ml-py) when installed, else nvidia-smi, else []."""
    try:
        import pynvml  # noqa: WPS433 - optional dependency
        pynvml.nvmlInit()
        try:
            out = []
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                            "memory_total_mib": mem.total // 2**20, "memory_used_mib": mem.used // 2**20,
                            "memory_free_mib": mem.free // 2**20, "driver_version": drv})
            return out, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML absent or broken: fall back to nvidia-smi
        pass
    smi = find_binary("nvidia-smi", required=False)
    if not smi:
        return [], None
    res = run([smi, "--query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version",
               "--format=csv,noheader,nounits"], timeout=30, check=False)
    out = []
    if res.rc == 0:
        for line in res.stdout.splitlines():
            f = [x.strip() for x in line.split(",")]
            if len(f) == 7:
                out.append({"index": int(f[0]), "name": f[1], "uuid": f[2], "memory_total_mib": int(f[3]),
                            "memory_used_mib": int(f[4]), "memory_free_mib": int(f[5]), "driver_version": f[6]})
    return out, "nvidia-smi"


def gpu_memory_by_pid():
    """{pid: bytes of GPU memory} through NVML, {} when NVML is not installed."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                out[proc.pid] = out.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
    except Exception:  # noqa: BLE001
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


def driver_version():
    """The kernel driver's version string (e.g. 580.159.04), or None."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9.]+)", fh.read())
            return m.group(1) if m else None
    except OSError:
        return None
