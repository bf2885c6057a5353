# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Kubernetes pod as the unit of GPU work to move: found through the API server (k8s/api.py, on the
controller, as kubernetes.core's modules run), described in the terms the node-side steps need (its node, its
containers' containerd ids, its GPU allocation), and refused, with the reason, when moving it could lose or
double the work; then the target pod a migration creates, and the end of the source's (waited for in
k8s/waits.py).

What is refused before anything is frozen, and why:
- a pod that is not Running, or one of whose containers is not running: there is nothing to move, or
  a restarting container would be checkpointed half-started;
- a container runtime other than containerd (``containerID`` scheme): the node-side backend is
  containerd's (namespace ``k8s.io``);
- a pod that a controller owns (Job, ReplicaSet, StatefulSet, DaemonSet, ...): once the source pod is
  deleted at the migration's end, its controller would start a fresh copy of the job next to the
  restored one. Orphan it first (``kubectl delete job --cascade=orphan``), or pass ``allow_owned``
  when the controller has been told otherwise (scaled down, suspended);
- a ``gpu_count`` other than the pod's: the driver's restore maps each GPU of the checkpoint onto one
  GPU (a one-to-one UUID map), so a process that used N GPUs can only come back on N GPUs.

Plain Python apart from the client, which is imported only when the API is reached: the rest of the
engine imports without it.
"""
from __future__ import annotations

import copy
import hashlib

from ..core.errors import InvalidTarget
from .api import api_error, core_api, find_pod, read_node, read_pod
from .restore_protocol import RESTORE_ANNOTATION, restore_request

DEFAULT_GPU_RESOURCES = ("nvidia.com/gpu",)
CONTAINERD_SCHEME = "containerd://"
# Fields of a pod the API server sets, or that tie it to its old node: left out of the spec the
# target's pod is created from.
_SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "selfLink",
                    "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences")
# What the target pod of a migration carries (RESTORE_ANNOTATION, the restore request, is the restore protocol's).
MIGRATION_ANNOTATION = "gpuckpt.fleet/migration-id"
SOURCE_NODE_ANNOTATION = "gpuckpt.fleet/source-node"
RESTORED_FROM_LABEL = "gpuckpt.fleet/restored-from"
DEFAULT_RESTORE_RUNTIME_CLASS = "gpuckpt-restore"


def gpus_asked(container, resources=DEFAULT_GPU_RESOURCES):
    """The GPUs of each of ``resources`` that a container's spec asks for (its limits; its requests
    where it sets no limit), as {resource: count} for those it asks for."""
    res = container.get("resources") or {}
    asked = dict(res.get("requests") or {})
    asked.update(res.get("limits") or {})
    out = {}
    for name in resources:
        if name in asked:
            try:
                out[name] = int(str(asked[name]))
            except ValueError:
                raise InvalidTarget("container %s asks for %r of %s, which is not a whole number of GPUs; nothing "
                                    "was frozen" % (container.get("name"), asked[name], name), stage="preflight")
    return out


def _check_running_on_a_node(where, spec, status):
    """The pod's node; refused when the pod is not Running there."""
    phase = status.get("phase")
    if phase != "Running":
        raise InvalidTarget("%s is %s, not Running; nothing was frozen" % (where, phase or "without a phase"),
                            stage="preflight")
    node = spec.get("nodeName")
    if not node:
        raise InvalidTarget("%s is not bound to a node; nothing was frozen" % where, stage="preflight")
    return node


def _controller(where, meta, allow_owned):
    """The controller that owns the pod (an ownerReference), or None; refused unless ``allow_owned``."""
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
    if not owners:
        return None
    o = owners[0]
    if not allow_owned:
        why = ("%s is owned by %s %s: once the migration deletes it, that controller would start a fresh copy of the "
               "job next to the restored one; nothing was frozen" % (where, o.get("kind"), o.get("name")))
        raise InvalidTarget(why, stage="preflight",
                            hint="orphan the pod first (kubectl delete %s %s --cascade=orphan), or set allow_owned "
                                 "once the controller will not replace it" % (str(o.get("kind")).lower(),
                                                                              o.get("name")))
    return o


def _containerd_id(where, container, container_status):
    """The containerd id of a running container; refused when it does not run, or runs under another runtime."""
    s = container_status
    if s is None or not (s.get("state") or {}).get("running"):
        state = ", ".join(sorted((s or {}).get("state") or {})) or "not started"
        raise InvalidTarget("container %s of %s is %s, not running; nothing was frozen"
                            % (container.get("name"), where, state), stage="preflight")
    cid = s.get("containerID") or ""
    if not cid.startswith(CONTAINERD_SCHEME):
        raise InvalidTarget("container %s of %s runs under %s, not containerd; only containerd's pods can be "
                            "checkpointed; nothing was frozen" % (container.get("name"), where,
                                                                  cid.split("://")[0] or "an unknown runtime"),
                            stage="preflight")
    return cid[len(CONTAINERD_SCHEME):]


def _describe_containers(where, spec, status, gpu_resources):
    """Each container of the pod as [{name, id, image, gpus, restart_count}], and the GPUs of each resource that
    they hold together; refused when one is not running under containerd, or when there is none."""
    statuses = {s.get("name"): s for s in status.get("containerStatuses") or []}
    containers, by_resource = [], {}
    for c in spec.get("containers") or []:
        s = statuses.get(c.get("name"))
        cid = _containerd_id(where, c, s)
        asked = gpus_asked(c, gpu_resources)
        for name, count in asked.items():
            by_resource[name] = by_resource.get(name, 0) + count
        containers.append({"name": c.get("name"), "id": cid, "image": c.get("image"),
                           "gpus": sum(asked.values()), "restart_count": s.get("restartCount", 0)})
    if not containers:
        raise InvalidTarget("%s has no containers; nothing was frozen" % where, stage="preflight")
    return containers, by_resource


def describe_pod(pod, gpu_resources=DEFAULT_GPU_RESOURCES, allow_owned=False):
    """What a pod checkpoint needs to know of ``pod`` (read_pod's dict), after the refusals in the
    module doc. Raises InvalidTarget."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    where = "pod %s/%s" % (meta.get("namespace"), meta.get("name"))
    node = _check_running_on_a_node(where, spec, status)
    owner = _controller(where, meta, allow_owned)
    containers, by_resource = _describe_containers(where, spec, status, gpu_resources)
    running_ephemeral = [s.get("name") for s in status.get("ephemeralContainerStatuses") or []
                         if (s.get("state") or {}).get("running")]
    claims = [c.get("name") for c in spec.get("resourceClaims") or []]
    return {"namespace": meta.get("namespace"), "name": meta.get("name"), "uid": meta.get("uid"), "node": node,
            "containers": containers, "gpu_count": sum(c["gpus"] for c in containers),
            "gpus_by_resource": by_resource, "resource_claims": claims,
            "ephemeral_containers_running": running_ephemeral, "owner": owner,
            "spec": restorable_pod(pod)}


def check_gpu_count(described, gpu_count):
    """``gpu_count`` asked for the restore, against the GPUs the pod holds: the same number, or a refusal."""
    if gpu_count is None:
        return
    held = described["gpu_count"]
    if described["resource_claims"] and not held:
        raise InvalidTarget("pod %s/%s takes its GPUs through resource claims (%s), whose count this check cannot read; "
                            "leave gpu_count unset, the target's restore maps the checkpoint's GPUs one to one"
                            % (described["namespace"], described["name"], ", ".join(described["resource_claims"])),
                            stage="preflight")
    if int(gpu_count) != held:
        raise InvalidTarget("pod %s/%s holds %d GPU(s); it cannot be restored onto %d: the driver restores each GPU of "
                            "a checkpoint onto exactly one GPU (a one-to-one map of GPU UUIDs), so the count must "
                            "stay %d; nothing was frozen" % (described["namespace"], described["name"], held,
                                                             int(gpu_count), held),
                            stage="preflight", hint="drop gpu_count, or set it to %d" % held)


def restorable_pod(pod):
    """The pod as the target's copy is created from: its spec and identity, less what the API server
    sets and the node it ran on (the restore pins the copy to its target node)."""
    meta = {k: v for k, v in (pod.get("metadata") or {}).items() if k not in _SERVER_METADATA}
    spec = dict(pod.get("spec") or {})
    spec.pop("nodeName", None)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def check_target_node(api, node, source_node):
    """The node a pod is to be restored onto: known to the API server, Ready, and not the pod's own.
    Returns its description (name, ready, unschedulable, GPU capacity and allocatable)."""
    if node == source_node:
        raise InvalidTarget("the pod already runs on node %s; a migration needs another node; nothing was frozen" % node,
                            stage="preflight")
    n = read_node(api, node)
    conditions = {c.get("type"): c.get("status") for c in (n.get("status") or {}).get("conditions") or []}
    if conditions.get("Ready") != "True":
        raise InvalidTarget("node %s is not Ready (Ready=%s); nothing was frozen" % (node, conditions.get("Ready")),
                            stage="preflight")
    status = n.get("status") or {}
    return {"name": node, "ready": True, "unschedulable": bool((n.get("spec") or {}).get("unschedulable")),
            "capacity": status.get("capacity") or {}, "allocatable": status.get("allocatable") or {}}


def check_target_gpus(described, target):
    """The target node must offer at least the GPUs the pod holds (its allocatable count of each GPU
    resource); the device plugin then picks which ones."""
    for name, need in sorted(described["gpus_by_resource"].items()):
        have = target["allocatable"].get(name)
        if need and (have is None or int(str(have)) < need):
            raise InvalidTarget("node %s offers %s of %s; pod %s/%s needs %d; nothing was frozen"
                                % (target["name"], have or "none", name, described["namespace"], described["name"],
                                   need), stage="preflight")


def inventory_host_for_node(node, hostvars, hosts):
    """The inventory host that is Kubernetes node ``node``: the one whose ``gpuckpt_k8s_node_name`` is
    ``node``, else the one named ``node``. Raises ValueError when none or several are."""
    named = [h for h in hosts if (hostvars.get(h) or {}).get("gpuckpt_k8s_node_name") == node]
    if not named and node in hosts and not (hostvars.get(node) or {}).get("gpuckpt_k8s_node_name"):
        named = [node]
    if len(named) != 1:
        raise ValueError("%s of the inventory's hosts %s Kubernetes node %s (set gpuckpt_k8s_node_name on the host "
                         "that is, when its inventory name differs)"
                         % (len(named) or "none", "is" if len(named) < 2 else "are", node))
    return named[0]


# ---- the target pod of a restore, and the source pod's end ------------------------------------------------
def target_pod_name(source_name, migration_id):
    """The default name of a migration's target pod: the source's name and a short digest of the migration id
    (the source is held, under its own name, until the target runs; a rerun of the migration finds the same
    name). Within the 63 characters of a hostname, which is what the pod's name becomes inside it."""
    suffix = "-" + hashlib.sha256(str(migration_id).encode()).hexdigest()[:6]
    return source_name[:63 - len(suffix)].rstrip("-.") + suffix


def target_pod(described, target_node, name, image_dir, token, runtime_class=DEFAULT_RESTORE_RUNTIME_CLASS,
               migration_id=None):
    """The pod the restore creates: the source's recorded spec (describe_pod's ``spec``), named ``name`` (a
    second pod of the source's name cannot exist while the source is held), pinned to ``target_node``, run by
    the restore runtime class, and carrying the restore request that the node's runtime handler checks
    against the ticket the node wrote (k8s/restore_protocol.py)."""
    pod = copy.deepcopy(described["spec"])
    meta, spec = pod.setdefault("metadata", {}), pod.setdefault("spec", {})
    meta["name"] = name
    meta["namespace"] = described["namespace"]
    meta.setdefault("labels", {})[RESTORED_FROM_LABEL] = described.get("uid") or ""
    meta.setdefault("annotations", {})[RESTORE_ANNOTATION] = restore_request(image_dir, token)
    meta["annotations"][SOURCE_NODE_ANNOTATION] = described.get("node") or ""
    if migration_id:
        meta["annotations"][MIGRATION_ANNOTATION] = migration_id
    spec["nodeName"] = target_node  # bound by us: the scheduler is not asked, the node was checked
    spec["runtimeClassName"] = runtime_class
    return pod


def create_pod(api, pod):
    """Create ``pod``; (changed, the pod as the API returns it). A pod of that name that carries the same
    restore request is this restore's own (a rerun): not changed. Any other pod of that name is refused."""
    from kubernetes.client.exceptions import ApiException
    meta = pod["metadata"]
    try:
        made = core_api(api).create_namespaced_pod(meta["namespace"], pod)
        return True, api.sanitize_for_serialization(made)
    except ApiException as exc:
        if exc.status != 409:
            raise api_error(exc, "creating pod %s/%s" % (meta["namespace"], meta["name"]))
    there = read_pod(api, meta["namespace"], meta["name"])
    if ((there.get("metadata") or {}).get("annotations") or {}).get(RESTORE_ANNOTATION) != \
            meta["annotations"][RESTORE_ANNOTATION]:
        raise InvalidTarget("a pod %s/%s that this restore did not create already exists; nothing was restored"
                            % (meta["namespace"], meta["name"]), stage="preflight",
                            hint="name the target pod otherwise (target_pod_name)")
    return False, there


def delete_migration_pod(api, namespace, name, migration_id, grace_period=None):
    """Delete the target pod of migration ``migration_id`` (a rollback): only a pod of that name that carries
    this migration's annotation, and only that very pod (its uid as the precondition). Returns
    (deleted now, uid or None)."""
    pod = find_pod(api, namespace, name)
    if pod is None:
        return False, None
    meta = pod.get("metadata") or {}
    if (meta.get("annotations") or {}).get(MIGRATION_ANNOTATION) != migration_id:
        raise InvalidTarget("pod %s/%s is not the target pod of migration %s (its annotation %s says %r); it was not "
                            "deleted" % (namespace, name, migration_id, MIGRATION_ANNOTATION,
                                         (meta.get("annotations") or {}).get(MIGRATION_ANNOTATION)),
                            stage="rollback-target")
    return delete_pod(api, namespace, name, meta.get("uid"), grace_period), meta.get("uid")


def migration_pod(api, namespace, name, migration_id):
    """The target pod of migration ``migration_id`` named ``name`` (a rerun after the source pod was deleted, or
    a recovery), as {namespace, name, uid, node, source_node, phase}; None when there is none."""
    pod = find_pod(api, namespace, name)
    meta = (pod or {}).get("metadata") or {}
    ann = meta.get("annotations") or {}
    if pod is None or ann.get(MIGRATION_ANNOTATION) != migration_id:
        return None
    return {"namespace": namespace, "name": name, "uid": meta.get("uid"), "node": (pod.get("spec") or {}).get("nodeName"),
            "source_node": ann.get(SOURCE_NODE_ANNOTATION), "phase": (pod.get("status") or {}).get("phase")}


def delete_pod(api, namespace, name, uid, grace_period=None):
    """Delete pod ``namespace/name`` only while it is the pod of ``uid`` (the API's precondition): a pod
    made since under the same name is never deleted. ``grace_period``: seconds the kubelet gives its containers
    between SIGTERM and SIGKILL (the pod's own by default). Returns whether it was deleted now."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                  grace_period_seconds=grace_period)
    try:
        core_api(api).delete_namespaced_pod(name, namespace, body=body)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        if exc.status == 409:
            raise InvalidTarget("pod %s/%s is no longer the pod %s (it was replaced); it was not deleted"
                                % (namespace, name, uid), stage="release-source")
        raise api_error(exc, "deleting pod %s/%s" % (namespace, name))
