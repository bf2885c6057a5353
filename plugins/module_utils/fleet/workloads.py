# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU workloads of one node, as a drain moves them: one entry per thing that moves as a whole.

A workload is either a container (of any runtime ``cuda_process_facts`` lists: runc, Podman, Docker,
containerd, runsc) that holds CUDA processes, a Kubernetes pod (the containers of containerd's namespace k8s.io
that the kubelet's labels name as one pod's, moved together with the pod path), or a bare process tree whose processes hold CUDA contexts and
belong to no container. A bare tree's root is found by walking up from each CUDA process through parents of
the same process group that have no controlling terminal: a launcher (torchrun, a job script run by cron or
a scheduler) moves with its workers, while the login shell or sshd session that started it stays. torchrun's
agent starts each rank in a session of its own: a rank (its environment names its elastic run,
``TORCHELASTIC_RUN_ID``) walks on up to its agent, so the agent and all its ranks are one workload that needs
their GPUs on one target. CUDA processes with the same root are one workload, and so is a root inside another
root's tree (a launcher of another kind whose workers start sessions of their own, under a launcher that holds a
CUDA context).

Each workload carries the facts of its tree in the shape of ``cuda_process_facts``' ``tree`` (pids, CUDA
states, RSS, GPU memory per GPU or unknown), which is what ``migration/planner.py`` checks.
"""
from __future__ import annotations

from ..core import procfs
from ..k8s.names import K8S_NAMESPACE, POD_NAME, POD_NAMESPACE, POD_UID


def _elastic_worker(pid, read_environ):
    """Whether ``pid`` is a worker that torchrun's agent started (its parent is then that agent)."""
    return bool(read_environ(pid).get("TORCHELASTIC_RUN_ID"))


def tree_root(pid, read_stat=procfs.read_stat, read_environ=procfs.environ):
    """The root of the bare process tree that ``pid`` belongs to (see the module doc)."""
    st = read_stat(int(pid))
    if st is None:
        return int(pid)
    root = st
    while root["ppid"] > 1:
        parent = read_stat(root["ppid"])
        if parent is None or parent["tty_nr"] != 0 or parent["flags"] & procfs.PF_KTHREAD:
            break
        if parent["pgrp"] != root["pgrp"] and not _elastic_worker(root["pid"], read_environ):
            break
        root = parent
    return root["pid"]


def _key(runtime, ident):
    return "%s:%s" % (runtime, ident)


def _in_pod(c):
    return c.get("runtime") == "containerd" and c.get("namespace") == K8S_NAMESPACE


def _pod_of(c):
    """"namespace/name" of the pod a k8s.io container belongs to, by the kubelet's labels; None without them."""
    labels = c.get("labels") or {}
    if labels.get(POD_NAMESPACE) and labels.get(POD_NAME):
        return "%s/%s" % (labels[POD_NAMESPACE], labels[POD_NAME])
    return None


def pod_containers(facts):
    """The containers of containerd's namespace k8s.io that hold CUDA processes and carry no kubelet labels
    naming their pod: a drain does not move them as plain containers behind the kubelet's back, nor as a pod it
    cannot name; it names them and leaves them."""
    return [c for c in facts.get("gpu_containers") or [] if _in_pod(c) and not _pod_of(c)]


def _pods(containers, tree_of):
    """One workload per Kubernetes pod whose containers hold CUDA processes: a pod moves whole (its tree is the
    union of its containers' trees), through the API server and the target node's restore handler."""
    by_pod = {}
    for c in containers:
        if _in_pod(c) and _pod_of(c):
            by_pod.setdefault(_pod_of(c), []).append(c)
    out = []
    for pod, members in sorted(by_pod.items()):
        members = sorted(members, key=lambda c: c["id"])
        pids = sorted({int(p) for c in members for p in (c.get("pids") or [c["pid"]])})
        root = int(members[0]["pid"])
        out.append({"key": _key("k8s_pod", pod), "kind": "pod", "runtime": "k8s_pod", "pod": pod,
                    "pod_uid": (members[0].get("labels") or {}).get(POD_UID), "containers": [c["id"] for c in members],
                    "root_pid": root, "tree": tree_of(root, pids)})
    return out


def _container(c, tree_of):
    """The workload of one of ``gpu_containers``."""
    runtime, cid = c.get("runtime"), c.get("id")
    sandboxed = any(p.get("in_sandbox") for p in c.get("cuda_processes") or [])
    tree = tree_of(int(c["pid"]), None if sandboxed else c.get("pids"))
    if sandboxed:  # the sandbox's own pids: its CUDA processes are asked inside it, not on the host
        tree = dict(tree, cuda_pids=[p["pid"] for p in c["cuda_processes"]],
                    cuda_states={str(p["pid"]): p.get("cuda_state") for p in c["cuda_processes"]})
    # containerd's ids are unique per namespace only: the key (and the move's migration id) names both.
    ident = "%s/%s" % (c["namespace"], cid) if c.get("namespace") else cid
    w = {"key": _key(runtime, ident), "kind": "container", "runtime": runtime, "container": cid,
         "root_pid": int(c["pid"]), "tree": tree}
    if c.get("namespace"):
        w["namespace"] = c["namespace"]
    return w


def _bare_trees(procs, tree_of, read_stat, driver_answers=False, read_environ=procfs.environ):
    """The workloads of the CUDA processes of ``procs`` that are in no container, one per tree root. When the
    driver answers, a process it knows no CUDA context of (it only holds /dev/nvidia*: nvidia-persistenced, a
    DCGM host engine) is no workload; when it does not, every holder is listed, and the planner's checkpoint
    API check says why it cannot move."""
    roots = set()
    for p in procs:
        if driver_answers and not p.get("cuda_state"):
            continue
        if p.get("exists", True) and not p.get("container") and not p.get("in_sandbox"):
            roots.add(tree_root(p["pid"], read_stat, read_environ))
    out = []
    for root in sorted(roots - _nested(roots, read_stat)):
        st = read_stat(root) or {}
        out.append({"key": _key("process", root), "kind": "process", "runtime": "process", "pid": root,
                    "root_pid": root, "comm": st.get("comm"), "starttime": st.get("starttime"), "tree": tree_of(root, None)})
    return out


def _nested(roots, read_stat):
    """The roots that lie inside another root's tree (one of them is an ancestor): they move with it. A launcher whose
    workers each start a session of their own (torchrun's ranks, when their elastic run is not in their environment)
    holds them in its tree when it is a root too (it holds a CUDA context of its own): one job, one workload."""
    inside = set()
    for root in roots:
        st, seen = read_stat(root), set()
        while st is not None and st["ppid"] > 1 and st["ppid"] not in seen:
            seen.add(st["ppid"])
            if st["ppid"] in roots:
                inside.add(root)
                break
            st = read_stat(st["ppid"])
    return inside


def from_facts(facts, tree_of, read_stat=procfs.read_stat, read_environ=procfs.environ):
    """The node's workloads from its ``cuda_process_facts`` (``cuda_processes`` and ``gpu_containers``);
    ``tree_of(root_pid, pids=None)`` gives a tree's facts. Sorted by key, so every run lists them alike."""
    containers = facts.get("gpu_containers") or []
    out = [_container(c, tree_of) for c in containers if not _in_pod(c)] + _pods(containers, tree_of)
    out += _bare_trees(facts.get("cuda_processes") or [], tree_of, read_stat,
                       bool((facts.get("driver") or {}).get("available")), read_environ)
    return sorted(out, key=lambda w: w["key"])


def _matches(w, selector):
    """A selector names a runtime (``runc``, ``k8s_pod``), a container (its id), a pod (``namespace/name``), or a
    pid of the workload."""
    s = str(selector)
    return s in (w["runtime"], str(w.get("container")), str(w.get("pod")), str(w["root_pid"])) or \
        s in [str(p) for p in (w["tree"].get("pids") or [])] or s in (w.get("containers") or [])


def select(workloads, include=None, exclude=None):
    """(chosen, left out with the reason): ``include`` keeps only the workloads one of its selectors
    names (none given: all), ``exclude`` then drops those one of its selectors names."""
    chosen, left = [], []
    for w in workloads:
        if include and not any(_matches(w, s) for s in include):
            left.append(dict(w, reason="not named by include (%s)" % ", ".join(map(str, include))))
        elif exclude and any(_matches(w, s) for s in exclude):
            left.append(dict(w, reason="named by exclude"))
        else:
            chosen.append(w)
    return chosen, left


def discover(facts, libcuda_path=None):
    """The workloads of this host, from its facts (cuda_process_facts'), each with its tree's facts and the
    ``identities`` of its processes (pid, start time, boot: a drain's end tells the node's own workloads from
    the copies its moves committed, which the node sees too where both share one pid space)."""
    from ..core.journal import identities
    from ..cuda import driver as cuda_driver
    from ..engine import facts as host_facts
    drv, unused = cuda_driver.load(libcuda_path)
    found = from_facts(facts, lambda root, pids: host_facts.tree_facts(drv, root, pids))
    for w in found:
        w["identities"] = identities(sorted({int(w["root_pid"])} | {int(p) for p in w["tree"].get("pids") or []}))
    return found


def with_pods(workloads, api_pods, allow_owned=False):
    """The workloads with what the API server says of each pod (``api_pods``: gpu_k8s_node's ``gpu_pods``, or a
    text saying why the API server was not read): its GPUs by resource and its uid, and ``refused`` with the reason
    when it cannot move wherever it would go - the API server was not read, it knows no such pod (or another pod
    has its name now), describe_pod refuses it, or a controller owns it and ``allow_owned`` is not given (once
    the migration deletes it, the controller would start a fresh copy next to the restored one). Also (the
    workloads, the API's GPU pods that no workload is: they ask for GPUs but hold no CUDA context here)."""
    known = {p["pod"]: p for p in api_pods} if isinstance(api_pods, list) else {}
    out = []
    for w in workloads:
        if w["kind"] != "pod":
            out.append(w)
            continue
        p = known.get(w["pod"])
        extra = {"gpus_by_resource": (p or {}).get("gpus_by_resource") or {}, "pod_uid": (p or {}).get("uid", w.get("pod_uid"))}
        why = _pod_refusal(w, p, api_pods, allow_owned)
        if why:
            extra["refused"] = why
        out.append(dict(w, **extra))
    moved = {w["pod"] for w in workloads if w["kind"] == "pod"}
    return out, [p for p in known.values() if p["pod"] not in moved]


def _pod_refusal(w, p, api_pods, allow_owned):
    """Why the pod workload ``w`` cannot move wherever it would go (``p``: the API server's word on it), or None."""
    if not isinstance(api_pods, list):
        return "the Kubernetes API server was not read (%s)" % (api_pods or "no connection given")
    if p is None or (w.get("pod_uid") and p.get("uid") != w["pod_uid"]):
        return "the API server shows no pod %s with the uid its containers carry (%s)" % (w["pod"], w.get("pod_uid"))
    if p.get("refused"):
        return p["refused"]
    if p.get("owner") and not allow_owned:
        return ("owned by %s %s: once the move deletes it, that controller would start a fresh copy next to the "
                "restored one (orphan it first, or set gpuckpt_allow_owned=true once the controller will not "
                "replace it)" % (p["owner"].get("kind"), p["owner"].get("name")))
    return None
