# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fence of a protected job on its node: whether this node still owns the job, as its replicas say, and when
not, its copy here stopped (see protect.py). Never two copies: a node cut off while its job was failed over runs a
stale copy until its first collection operation (its timer, facts, drain, recover) does this."""
from __future__ import annotations

import os
import signal

from ..core import procfs
from ..core.errors import GpuCkptError
from ..core.run import run as run_command
from ..engine.steps import now_iso
from . import protect_history as hist
from .protect_job import apply_environment, read_pid, replica_call, replica_ref, replica_target, target_and_backend, timer_unit

FENCE_IO_TIMEOUT = 20  # seconds a fence check gives each replica to answer (ssh's connect timeout follows it)
PID_FILE_SLACK = 5.0   # a pid file is written after its process starts: a process younger than the file by more is another


def fence_state(cfg, folder):
    """fenced.json when it applies to this config: a config of a later epoch (the job protected here again
    after it came back) lifts it."""
    doc = hist.read_state(folder, hist.FENCED)
    if doc and int(doc.get("epoch") or 0) >= cfg["epoch"]:
        return doc
    return None


def check_fence(cfg, folder, act=True, trigger="check"):
    """Ask each replica whether this node still owns the job. Returns {"job", "fenced", ...}: with ``act``, a
    fenced copy is stopped, its timer disabled and fenced.json written; without, what would be stopped."""
    known = fence_state(cfg, folder)
    if known:
        return dict(known, fenced=True, already=True, changed=False)
    unreachable = {}
    for rep in cfg["replicas"]:
        try:
            reply = replica_call(replica_target(rep, FENCE_IO_TIMEOUT), dict(replica_ref(cfg, rep), replica_op="check",
                                                                             create=False), timeout=FENCE_IO_TIMEOUT * 3)
        except (GpuCkptError, OSError) as exc:  # a replica that does not answer is no fence: the push will tell
            unreachable[rep["name"]] = getattr(exc, "msg", None) or str(exc)
            continue
        if reply.get("fenced"):
            return _fence(cfg, folder, rep, reply, act, trigger)
    return {"job": cfg["job"], "fenced": False, "changed": False, "epoch": cfg["epoch"], "unreachable": unreachable}


def _fence(cfg, folder, rep, reply, act, trigger):
    said = reply.get("error") or reply.get("reason") or "the job was failed over"
    if "fenced" not in said:
        said = "%s; the copy on %s (epoch %s) is fenced" % (said, cfg["node"], cfg["epoch"])
    doc = {"job": cfg["job"], "node": cfg["node"], "at": now_iso(), "epoch": cfg["epoch"], "replica": rep["name"],
           "replica_epoch": reply.get("epoch"), "owner": reply.get("owner"), "reason": "replica %s: %s" % (rep["name"], said)}
    if not act:
        return dict(doc, fenced=True, changed=False, stopped=None, would_stop=hist.workload_of(cfg))
    apply_environment(cfg)
    doc["stopped"] = stop_local_copy(cfg, folder)
    doc["timer"] = disable_timer(cfg["job"])
    hist.write_state(folder, hist.FENCED, doc)
    hist.append_history(folder, {"at": doc["at"], "job": cfg["job"], "result": "fenced", "reason": doc["reason"],
                                 "trigger": trigger, "epoch": cfg["epoch"], "replica_epoch": doc["replica_epoch"],
                                 "stopped": doc["stopped"]})
    return dict(doc, fenced=True, changed=True, already=False)


def _boot_time():
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def is_the_job(pid, pid_file, ident):
    """Whether ``pid`` (read from ``pid_file``) is still the job's process, not a later process that took its pid:
    the identity the last checkpoint recorded (pid and start time) when it is of this pid, else a start no later
    than the pid file was written."""
    st = procfs.read_stat(pid)
    if st is None or st["state"] in ("Z", "X"):
        return False
    return identity_is_the_job({"pid": pid, "starttime": st["starttime"], "boot_id": procfs.boot_id()}, pid_file, ident)


def identity_is_the_job(proc, pid_file, ident):
    """is_the_job's rule for a process known by its identity ``proc`` ({"pid", "starttime", "boot_id"}: a live
    process's, or one a migration's journal recorded before it moved it away): the job's ``ident`` (identity.json,
    its last checkpoint's) when it is of this pid (the same start time and boot), else a start of ``proc`` no later
    than ``pid_file`` was written (the start of a process of an earlier boot cannot be told: not the job's)."""
    boot = procfs.boot_id()
    if ident and ident.get("pid") == proc["pid"]:
        return (ident.get("starttime") == proc.get("starttime")
                and (ident.get("boot_id") or boot) == (proc.get("boot_id") or boot))
    if proc.get("boot_id") and boot and proc["boot_id"] != boot:
        return False
    try:
        written = os.stat(pid_file).st_mtime
    except OSError:
        return False
    btime = _boot_time()
    if btime is None or proc.get("starttime") is None:
        return True
    return btime + proc["starttime"] / float(os.sysconf("SC_CLK_TCK")) <= written + PID_FILE_SLACK


def _kill_tree(root):
    """Stop the tree of ``root`` (SIGSTOP, walking it again until no new process shows: none forks away),
    then SIGKILL every one of it. Returns (its pids, those still there after 10 s)."""
    seen = []
    while True:
        new = [p for p in procfs.process_tree(root) if p not in seen]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        seen += new
    for p in seen:
        _signal(p, signal.SIGKILL)
    return seen, procfs.wait_gone(seen, 10)


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def stop_local_copy(cfg, folder):
    """Stop the job's copy on this node: a pid file's whole process tree (only while its pid is still the job's),
    or a container or pod through its runtime. Returns what was done, in a dict."""
    if cfg.get("pid_file"):
        pid = read_pid(cfg["pid_file"])
        if pid is None:
            return {"stopped": [], "note": "%s names no process" % cfg["pid_file"]}
        if not is_the_job(pid, cfg["pid_file"], hist.read_state(folder, hist.IDENTITY)):
            return {"stopped": [], "note": "pid %d of %s is no longer the job's process" % (pid, cfg["pid_file"])}
        pids, left = _kill_tree(pid)
        return {"stopped": pids, "left": left, "how": "SIGKILL to the tree of pid %d" % pid}
    target, backend = target_and_backend(cfg)
    try:
        unused, pids = backend.resolve(target)
    except GpuCkptError as exc:
        return {"stopped": [], "note": "%s does not run here: %s" % (hist.workload_of(cfg), exc.msg)}
    if cfg.get("pod"):  # (the kubelet's: its containers' processes go; the pod object is the API server's)
        for p in pids:
            _signal(p, signal.SIGKILL)
        return {"stopped": pids, "left": procfs.wait_gone(pids, 10), "how": "SIGKILL to the pod's containers"}
    backend.with_container(target).kill(pids)
    return {"stopped": pids, "how": "%s removed the container %s" % (backend.name, target)}


def disable_timer(job):
    """``systemctl disable --now`` the job's timer where systemd runs; what happened, in words."""
    if not os.path.isdir("/run/systemd/system"):
        return "no systemd here: no timer to disable"
    res = run_command(["systemctl", "disable", "--now", timer_unit(job)], check=False, timeout=60, stage="fence")
    return "disabled %s" % timer_unit(job) if res.rc == 0 else "systemctl could not disable %s: %s" % (
        timer_unit(job), (res.stderr or res.stdout or "").strip()[-300:])
