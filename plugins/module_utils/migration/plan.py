# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The plan of one migration, made on the source before anything is frozen (``gpu_migration action=plan``).

migrate.yml (tasks/migrate_one.yml) and recover.yml run module calls; what to call, and with what, is decided
here, in one record:

- ``settle``: this id left a journal on either host, so the run finishes or rolls back that migration, and
  ``id_reuse``: why the workload named now is not the one the id was used for (a pid of the journal that another
  process holds now is another workload), "" when it is;
- ``runtime``: the runtime named (a pod, a container of ``runtime``, else a bare process tree), its ``root_pid``
  as the backend resolves it (the backend's ``resolve()``, never the runtime's CLI again), the ``workload`` in
  words, and ``error``: why the workload could not be found (said by the playbook after its own checks);
- ``hold_stopped`` or exit and ``exit_reason``: from the backend's capabilities (``can_hold_stopped``,
  ``restores_host_pids``) and the facts of the two hosts (one kernel, one pid space, a network namespace the
  copy would share with the held source's bound sockets);
- the pods of a pod migration (``pod_ref``, ``target_pod``, ``restore_token``);
- ``calls``: the arguments of the later module calls that depend on the workload (the source's and the target's
  facts, the preflight's options, the checkpoint).

The decisions are pure functions of their inputs (unit-tested with tables); ``make`` reads the host through the
probe it is given (``HostProbe`` on the source).
"""
from __future__ import annotations

import random
import string

from ..core import procfs
from .planner import id_reuse

DEFAULT_CONTAINER_RUNTIME = "runc"
POD_RUNTIME = "k8s_pod"
PROCESS_RUNTIME = "process"
TOKEN_CHARS = string.ascii_letters + string.digits


def named(pid=None, container=None, pod=None):
    """The workloads named (pid > 0, a container, a pod): a new migration needs exactly one."""
    out = []
    if pid and int(pid) > 0:
        out.append("pid")
    if container:
        out.append("container")
    if pod:
        out.append("pod")
    return out


def runtime_of(container=None, pod=None, runtime=None):
    """The runtime of the workload named: a pod's, a container's (``runtime``, runc by default), else a process."""
    if pod:
        return POD_RUNTIME
    if not container:
        return PROCESS_RUNTIME
    return runtime or DEFAULT_CONTAINER_RUNTIME


def workload_words(pid=None, container=None, pod=None):
    """The workload in words, as the summary names it."""
    return ("pod %s" % pod) if pod else ("container %s" % container) if container else ("pid %s" % pid)


def pod_ref(move_pod=None, journal=None):
    """A pod migration's source pod ({namespace, name, uid}): as gpu_pod_info described it (``move_pod``), or as the
    source's journal recorded it (a re-run, recover.yml); None for any other workload."""
    if isinstance(move_pod, dict):
        return {"namespace": move_pod.get("namespace"), "name": move_pod.get("name"), "uid": move_pod.get("uid")}
    journal = journal or {}
    if journal.get("runtime") == POD_RUNTIME and isinstance(journal.get("pod"), dict):
        return journal["pod"]
    return None


def hold_or_exit(capabilities, runtime, source_host, target_host, tree, target="the target"):
    """How the source waits while the target restores: (hold_stopped, exit_reason, one_pid_space).

    The source stays stopped (held, resumed on a rollback) unless its copy on the target would clash with it:
    - a runtime that cannot hold a workload stopped (``can_hold_stopped`` False: Podman and Docker checkpoint only
      running containers) exits, its image the way back;
    - a held source keeps its listening ports and abstract socket names bound: a copy restored into the same
      network namespace (one kernel, host networking) could not bind them again;
    - a restore that brings the dumped pids back under their numbers (``restores_host_pids``: a bare process tree)
      needs them free, which a held source in the same pid space keeps.
    ``source_host`` and ``target_host``: each host's boot_id, pid_namespace and net_namespace; ``tree``: the
    workload's bound_sockets and net_namespace (as cuda_process_facts reports its tree)."""
    one_kernel = source_host.get("boot_id") == target_host.get("boot_id")
    one_pid_space = bool(one_kernel and source_host.get("pid_namespace") == target_host.get("pid_namespace"))
    sockets = tree.get("bound_sockets") or []
    net_clash = bool(one_kernel and len(sockets) > 0
                     and tree.get("net_namespace", "") == target_host.get("net_namespace", "-"))
    if not capabilities.can_hold_stopped:
        reason = "%s cannot hold a container stopped" % runtime.capitalize()
    elif net_clash:
        reason = "the workload holds %s in the network namespace that its copy on %s would use" % (
            ", ".join(sockets), target)
    elif capabilities.restores_host_pids and one_pid_space:
        reason = "source and target share one pid space"
    else:
        reason = ""
    hold = capabilities.can_hold_stopped and not net_clash and not (capabilities.restores_host_pids and one_pid_space)
    return bool(hold), reason, one_pid_space


def source_facts_call(runtime, root_pid, pod=None):
    """cuda_process_facts' arguments on the source: the tree of the root pid; a pod's, the union of its containers'
    trees, found on its node by the kubelet's labels."""
    if runtime == POD_RUNTIME:
        return {"container": "%s/%s" % (pod["namespace"], pod["name"]), "runtime": POD_RUNTIME}
    return {"tree_of": int(root_pid or 0)}


def checkpoint_call(runtime, hold, pid=None, container=None, pod=None, pod_containers=None):
    """gpu_checkpoint's arguments that the workload decides (the playbook adds the options)."""
    out = {"runtime": runtime, "leave_stopped": bool(hold)}
    if runtime == PROCESS_RUNTIME:
        out["pid"] = int(pid)
    if container:
        out["container"] = container
    if runtime == POD_RUNTIME and pod:
        out.update(pod="%s/%s" % (pod["namespace"], pod["name"]), pod_uid=pod.get("uid"),
                   pod_containers=list(pod_containers or []))
    return out


def _settle_part(params, journal, target_journal, probe):
    """An id that left a journal: the id-reuse verdict for the workload named now."""
    pid = int(params.get("pid") or 0)
    pid_now = None
    if pid and journal.get("exists"):
        st = probe.stat(pid)
        pid_now = {"starttime": st["starttime"]} if st else None
    reason = id_reuse(params["migration_id"], journal, pid=pid or None, container=params.get("container") or None,
                      pod=params.get("pod") or None, pid_now=pid_now, target_journal=target_journal or None)
    return {"id_reuse": reason or ""}


def _new_part(params, pod, probe):
    """A new migration: the runtime, the root pid the backend resolves, how the source waits, the later calls."""
    pid, container, pod_name = params.get("pid"), params.get("container"), params.get("pod")
    runtime = runtime_of(container, pod_name, params.get("runtime"))
    out = {"runtime": runtime, "workload": workload_words(pid, container, pod_name), "root_pid": None,
           "error": "", "hold_stopped": None, "exit_reason": "", "one_pid_space": None}
    if len(named(pid, container, pod_name)) != 1:
        return out
    if runtime == POD_RUNTIME and not pod:
        out["error"] = "%s was not described by the API server (gpu_pod_info)" % out["workload"]
        return out
    caps = probe.capabilities(runtime)
    try:
        root, tree = probe.resolve(runtime, pid, container, pod)
    except Exception as e:  # (said by the playbook after its own checks: nothing is frozen)
        out["error"] = "%s was not found on the source: %s" % (out["workload"], e)
        return out
    target_host = params.get("target_host") or {}
    hold, reason, one_pid_space = hold_or_exit(caps, runtime, probe.host(), target_host, tree,
                                               params.get("target_name") or "the target")
    out.update(root_pid=root, hold_stopped=hold, exit_reason=reason, one_pid_space=one_pid_space,
               # a container keeps its pids in its own pid namespace; a bare tree's must be free on the target
               restores_host_pids=bool(caps.restores_host_pids),
               calls={"source_facts": source_facts_call(runtime, root, pod),
                      "checkpoint": checkpoint_call(runtime, hold, pid, container, pod,
                                                    [c.get("name") for c in (params.get("move_pod") or {}).get(
                                                        "containers") or []])})
    return out


def make(params, journal, probe):
    """The migration's plan (see the module's docstring). ``params``: gpu_migration's (migration_id, pid,
    container, runtime, pod, move_pod, target_journal, target_host, target_name, target_pod_name, settle_only);
    ``journal``: the source's journal as ``transaction.status`` reads it; ``probe``: the host (HostProbe)."""
    target_journal = params.get("target_journal") or {}
    settle = bool(journal.get("exists") or target_journal.get("exists"))
    pod = pod_ref(params.get("move_pod"), journal)
    plan = {"settle": settle, "new": not settle and not params.get("settle_only"), "id_reuse": "", "pod_ref": pod,
            "target_pod": None, "restore_token": None, "calls": {}}
    if pod:
        name = params.get("target_pod_name") or probe.target_pod_name(str(pod["name"]), params["migration_id"])
        rng = random.SystemRandom()
        plan["target_pod"] = name
        plan["restore_token"] = "".join(rng.choice(TOKEN_CHARS) for dummy in range(40))
    if settle:
        plan.update(_settle_part(params, journal, target_journal, probe))
    elif plan["new"]:
        plan.update(_new_part(params, pod, probe))
    return plan


def host_identity():
    """This host's kernel and namespaces (its boot, pid and network namespaces): gpu_migration returns it with every
    journal it reads, so that the source's plan knows whether the target is the same kernel or pid space."""
    return {"boot_id": procfs.boot_id(), "pid_namespace": procfs.pid_namespace(), "net_namespace": procfs.net_namespace()}


class HostProbe(object):
    """What the plan reads of the source host: /proc, and the runtime's backend (built from the module's options);
    and the name of a pod migration's target pod (k8s/, a room above this one, handed in by the module)."""

    def __init__(self, build_backend, target_pod_name):
        self._build = build_backend  # runtime name -> its backend, from the module's options
        self.target_pod_name = target_pod_name  # (source pod's name, migration id) -> the target pod's (k8s/pods.py)

    def stat(self, pid):
        return procfs.read_stat(int(pid))

    @staticmethod
    def host():
        return host_identity()

    @staticmethod
    def capabilities(runtime):
        from ..runtimes.registry import backend_class
        return backend_class(runtime).capabilities

    def resolve(self, runtime, pid, container, pod):
        """(root pid, its tree's bound_sockets and net_namespace), as cuda_process_facts would report the tree:
        a bare tree and a container by their root's process tree, a pod by its containers' trees."""
        if runtime == PROCESS_RUNTIME:
            root = int(pid)
            pids = procfs.process_tree(root) if procfs.read_stat(root) is not None else []
        elif runtime == POD_RUNTIME:
            root, pids = self._build(runtime).resolve("%s/%s" % (pod["namespace"], pod["name"]))
        else:
            root = int(self._build(runtime).resolve(container)[0])
            pids = procfs.process_tree(root)
        if not pids:
            return root, {"bound_sockets": []}
        return root, {"bound_sockets": procfs.bound_sockets(pids), "net_namespace": procfs.net_namespace(int(root))}
