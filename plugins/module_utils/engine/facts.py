# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Facts of one host for cuda_process_facts and a migration's preflight: the driver and its checkpoint
API, the GPUs, the CUDA processes, CRIU, free disk, and a workload's tree (its pids, CUDA pids, bound
sockets, file locks and external unix sockets: what decides how it can be checkpointed)."""
from __future__ import annotations

import os
import socket

from ..core import procfs, sockets
from ..cuda import usage as gpu_usage
from ..cuda import processes as gpu_procs
from ..cuda import driver as cuda
from ..core.errors import GpuCkptError


def _free_bytes(path):
    """Free bytes of the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _sandbox_cuda(backend, container, libcuda_path):
    """The CUDA processes inside a running sandbox (gVisor), asked through the tool inside it: the host
    sees none of them. [] for a paused sandbox (an exec would wait for it) or a CPU one."""
    if container.get("status") != "running":
        return []
    backend = backend.with_container(container["id"], sandbox_host_pid=int(container["pid"]))
    drv, unused = backend.load_cuda(libcuda_path)
    out = []
    for p in backend.cuda_candidates(int(container["pid"]), [int(container["pid"])]):
        state = drv.state_or_error(p)
        if state is not None:
            out.append({"pid": p, "ns_pid": p, "cuda_state": state, "in_sandbox": True})
    return out


def gpu_containers(backends, procs, libcuda_path=None):
    """The containers of each runtime in ``backends`` whose processes include CUDA processes of
    ``procs`` (cuda_process_facts' list), with host and in-container pids; each such process is given
    its ``container``. A sandbox's CUDA processes (gVisor) are asked inside it, with its own pids.
    A runtime that cannot be asked is reported in the errors, not failed."""
    by_pid = {p["pid"]: p for p in procs if p.get("exists")}
    found, errors = [], {}
    for backend in backends:
        if backend.capabilities.cuda_in_sandbox:
            try:
                for c in backend.running_containers():
                    inside = _sandbox_cuda(backend, c, libcuda_path)
                    if inside:
                        found.append(dict(c, runtime=backend.name, pids=[int(c["pid"])], cuda_processes=inside))
            except GpuCkptError as exc:
                errors[backend.name] = exc.msg
            continue
        try:
            listed = backend.running_containers()
        except GpuCkptError as exc:
            errors[backend.name] = exc.msg
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a runtime's odd answer is not a failure of facts
            errors[backend.name] = "%s: %s" % (type(exc).__name__, exc)
            continue
        for c in listed:
            tree = procfs.process_tree(int(c["pid"]))
            cuda = [p for p in tree if p in by_pid]
            if not cuda:
                continue
            entry = dict(c, runtime=backend.name, pids=tree,
                         cuda_processes=[{"pid": p, "ns_pid": procfs.ns_pid(p), "cuda_state": by_pid[p].get("cuda_state")}
                                         for p in cuda])
            found.append(entry)
            for p in cuda:
                by_pid[p]["container"] = {k: entry[k] for k in ("runtime", "id", "namespace") if k in entry}
    return found, errors


def _host():
    return {"hostname": socket.gethostname(), "kernel": os.uname().release, "boot_id": procfs.boot_id(),
            "pid_namespace": procfs.pid_namespace(), "net_namespace": procfs.net_namespace()}


def _unknown_gpu_memory(source, reason):
    return {"gpu_bytes": None, "gpu_bytes_by_gpu": None, "gpu_memory_source": source,
            "gpu_memory_unknown_reason": reason}


def _unread_pids(apps, tpids, must_read):
    """The pids whose GPU memory the readings leave unknown: CUDA pids they do not list, and pids of the
    tree they list without a figure."""
    listed = {a["pid"] for a in apps}
    return sorted({p for p in must_read if p not in listed}
                  | {a["pid"] for a in apps if a["pid"] in tpids and a["bytes"] is None})


def tree_gpu_memory(tpids, cuda_states):
    """The GPU memory the tree's processes ``tpids`` hold (``cuda_states``: {pid: state} of its CUDA pids):
    ``gpu_bytes`` (None: unknown), ``gpu_bytes_by_gpu`` ({GPU UUID: bytes}), ``gpu_memory_source`` (nvml,
    nvidia-smi, or none: no process of the tree holds a GPU) and ``gpu_memory_unknown_reason``. Unknown is never counted as 0: it once sized a 25.6 GB image
    at 1.3 GiB. A checkpointed CUDA process holds its GPU memory in host RAM (its RSS), none on a GPU."""
    cuda_pids = {p for p, state in cuda_states.items() if state != "checkpointed"}
    holders = cuda_pids | {p for p in tpids if p not in cuda_states and gpu_procs.nvidia_fds(p)}
    if not holders:
        return {"gpu_bytes": 0, "gpu_bytes_by_gpu": {}, "gpu_memory_source": "none",
                "gpu_memory_unknown_reason": None}
    apps, source = gpu_usage.compute_apps()
    if apps is None:
        return _unknown_gpu_memory(None, "neither NVML (the Python module pynvml, package nvidia-ml-py) nor "
                                         "nvidia-smi could be asked on %s" % socket.gethostname())
    unread = _unread_pids(apps, set(tpids), cuda_pids)
    if unread:
        why = "%s reports no GPU memory for CUDA pid(s) %s" % (source, ",".join(map(str, unread)))
        bound, not_bound = used_memory_bound(apps, set(tpids), unread, source)
        return bound or _unknown_gpu_memory(source, "%s; %s" % (why, not_bound))
    by_gpu = {}
    for app in apps:
        if app["pid"] in tpids:
            by_gpu[app["gpu_uuid"]] = by_gpu.get(app["gpu_uuid"], 0) + app["bytes"]
    return {"gpu_bytes": sum(by_gpu.values()), "gpu_bytes_by_gpu": by_gpu, "gpu_memory_source": source,
            "gpu_memory_unknown_reason": None}


def _gpus_opened(pid, gpus):
    """The UUIDs of ``gpus`` whose device file (/dev/nvidia<minor>) ``pid`` holds open; empty when it names none."""
    minors = set()
    for path in gpu_procs.nvidia_fds(pid):
        tail = path[len("/dev/nvidia"):]
        if tail.isdigit():
            minors.add(int(tail))
    return {g["uuid"] for g in gpus if g.get("minor") is not None and g["minor"] in minors}


def used_memory_bound(apps, tpids, unread, source):
    """Where some CUDA processes of the tree (``unread``: torchrun's agent holds a CUDA context that nvidia-smi
    lists no memory for) leave its GPU memory unknown: a GPU's own used memory (NVML's, nvidia-smi's
    memory.used) is a measured upper bound of the tree's memory there when every process the driver lists on
    that GPU belongs to the tree, and the list shows at least one of them there (a list that shows none, as
    nvidia-smi in another pid namespace gives, may miss others too). The GPUs it may hold memory on: those its
    listed processes are on, and for a process nothing lists, those whose device file it holds open (every GPU
    when it names none). Returns (the tree's GPU memory as that bound, None) or (None, why there is no bound)."""
    gpus, gpu_source = gpu_usage.gpus()
    if not gpus:
        return None, "no reading of the GPUs' used memory bounds it (none answered)"
    where = _gpus_the_tree_may_use(apps, tpids, unread, gpus)
    why_not = _shared_or_unseen_gpu(apps, tpids, unread, where)
    if why_not:
        return None, why_not
    used = {g["uuid"]: g.get("memory_used_mib") for g in gpus if g["uuid"] in where}
    unmeasured = sorted(u for u in where if used.get(u) is None)
    if unmeasured:
        return None, "GPU %s reports no used memory to bound it" % unmeasured[0]
    by_gpu = {u: mib * gpu_usage.MIB for u, mib in used.items() if mib}
    return {"gpu_bytes": sum(by_gpu.values()), "gpu_bytes_by_gpu": by_gpu,
            "gpu_memory_source": "%s memory.used" % gpu_source, "gpu_memory_unknown_reason": None,
            "gpu_memory_bound": "an upper bound from the GPU's used memory (%s memory.used of GPU %s): every process "
                                "the driver lists there belongs to the tree, and %s reports no memory for pid(s) %s"
                                % (gpu_source, ", ".join(sorted(where)), source, ",".join(map(str, unread)))}, None


def _gpus_the_tree_may_use(apps, tpids, unread, gpus):
    """The uuids of the GPUs the tree may hold memory on (see used_memory_bound)."""
    listed = {a["pid"] for a in apps}
    where = {a["gpu_uuid"] for a in apps if a["pid"] in tpids}
    for p in unread:
        if p not in listed:
            where |= _gpus_opened(p, gpus) or {g["uuid"] for g in gpus}
    return where


def _shared_or_unseen_gpu(apps, tpids, unread, where):
    """Why the used memory of the GPUs ``where`` does not bound the tree's (a process not the tree's listed on one,
    or a GPU where the list shows none of the tree's), or None when it does."""
    others = sorted({(a["gpu_uuid"], a["pid"]) for a in apps if a["gpu_uuid"] in where and a["pid"] not in tpids},
                    key=str)
    if others:
        return ("the GPU's used memory bounds the tree's only where every process the driver lists there is the "
                "tree's, and GPU %s also runs pid %s" % others[0])
    seen_there = {a["gpu_uuid"] for a in apps if a["pid"] in tpids}
    unseen = sorted(where - seen_there)
    if unseen:  # (a list that shows none of the tree's processes there may not show every process there either)
        return ("the GPU's used memory bounds the tree's only where the driver's list shows the tree's processes "
                "and no other, and it shows none of them on GPU %s, which pid(s) %s may use"
                % (unseen[0], ",".join(map(str, unread))))
    return None


def _tree(drv, tree_of, tree_pids):
    """The workload's tree rooted at ``tree_of`` (see facts)."""
    if procfs.read_stat(int(tree_of)) is None:
        return {"root": int(tree_of), "exists": False, "pids": []}
    tpids = [int(p) for p in tree_pids] if tree_pids else procfs.process_tree(int(tree_of))
    states = {p: drv.state_or_error(p) for p in tpids} if drv else {}
    cuda_states = {p: state for p, state in states.items() if state is not None}
    out = {"root": int(tree_of), "exists": True, "pids": tpids, "cuda_pids": [p for p in tpids if p in cuda_states],
           "cuda_states": {str(p): state for p, state in cuda_states.items()},
           "rss_bytes": sum(procfs.rss_bytes(p) for p in tpids),
           "net_namespace": procfs.net_namespace(int(tree_of)),
           "bound_sockets": sockets.bound_sockets(tpids)}
    out.update(tree_gpu_memory(tpids, cuda_states))
    return out


def _driver(drv, problem, gpus):
    info = {"available": drv is not None, "driver_version": gpu_usage.driver_version()}
    if drv:
        info.update(drv.info())
    else:
        info.update(checkpoint_api=False, reason=problem.msg)
    if gpus and not info["driver_version"]:
        info["driver_version"] = gpus[0].get("driver_version")
    return info


def _candidates(pids, drv):
    """The pids to report: those asked for, else those holding a /dev/nvidia* file, and with a driver, every
    process it knows as a CUDA process (checkpointed processes hold no /dev/nvidia fd)."""
    if pids:
        return [int(p) for p in pids]
    # This module and the processes that run it (Ansible's wrapper, the shell of its ssh session): they load
    # the driver to ask it, which makes the driver know them, but they are no workload of this host.
    own = procfs.ancestors(os.getpid())
    found = [p for p in procfs.all_pids() if p not in own and gpu_procs.nvidia_fds(p)]
    if drv:
        found = sorted(set(found) | {p for p in procfs.all_pids()
                                     if p not in own and drv.state_or_error(p) is not None})
    return found


def _processes(candidates, drv):
    procs = []
    for p in candidates:
        if procfs.read_stat(p) is None:
            procs.append({"pid": p, "exists": False})
            continue
        info = gpu_procs.process_info(p, drv)
        info["exists"] = True
        procs.append(info)
    return procs


def _criu(criu_path, check_criu):
    criu = {"installed": False}
    try:
        from ..runtimes.criu import Criu
        c = Criu(criu_path)
        criu.update(installed=True, path=c.path, version=c.version())
        # where CRIU would find plugins, and CRIU's own cuda plugin if it is there (the collection loads none)
        criu["plugins"] = c.plugin_facts()
        criu["supported"] = tuple(int(x) for x in criu["version"].split(".")[:2]) >= (4, 0)
        if check_criu:
            ok, text = c.check()
            criu.update(check_ok=ok, check_output=text)
    except GpuCkptError as exc:
        criu["error"] = exc.msg
    return criu


def facts(pids=None, libcuda_path=None, criu_path=None, check_criu=True, paths=None, tree_of=None,
          check_pids=None, tree_pids=None):
    """What the host offers and, with ``tree_of``, the process tree of that root pid (``tree_pids``: the
    workload's pids as its runtime found them, when they are more than one tree: a pod's containers).
    ``gpu_source`` None: neither NVML nor nvidia-smi answered, and ``gpus`` [] then means "not known"."""
    drv, problem = cuda.load(libcuda_path)
    out = {"host": _host(), "memory": procfs.meminfo()}
    if paths:
        out["disk"] = {p: {"free_bytes": _free_bytes(p)} for p in paths}
    if tree_of:
        out["tree"] = _tree(drv, tree_of, tree_pids)
    if check_pids:
        out["pids_in_use"] = [int(p) for p in check_pids if procfs.read_stat(int(p)) is not None]
    gpus, source = gpu_usage.gpus()
    out["driver"] = _driver(drv, problem, gpus)
    out["gpus"] = gpus
    out["gpu_source"] = source
    out["cuda_device_uuids"] = drv.device_uuids() if drv else []
    out["cuda_processes"] = _processes(_candidates(pids, drv), drv)
    criu = _criu(criu_path, check_criu)
    out["criu"] = criu
    out["ready"] = bool(criu.get("supported") and criu.get("check_ok", True) and
                        (drv is not None or not gpus))
    return out


def tree_facts(drv, root, pids=None):
    """The facts of the workload tree rooted at ``root`` (as ``facts(tree_of=root)`` reports its ``tree``),
    with the driver already loaded (``drv``, None without one): a drain asks this of every workload."""
    return _tree(drv, root, pids)
