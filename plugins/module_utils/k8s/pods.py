# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Kubernetes pod as the unit of GPU work to move: found through the API server with the
``kubernetes`` Python client (on the controller, as kubernetes.core's modules run), described in the
terms the node-side steps need (its node, its containers' containerd ids, its GPU allocation), and
refused, with the reason, when moving it could lose or double the work.

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

Plain Python apart from the client, which is imported only when a pod is asked for: the rest of the
engine imports without it.
"""
from __future__ import annotations

import copy
import os

from ..core.errors import GpuCkptError, InvalidTarget

# The connection options, shared by every module that reaches the API server (kubernetes.core's
# AUTH_ARG_SPEC, and its K8S_AUTH_* environment variables, are the model).
AUTH_ARG_SPEC = dict(
    kubeconfig=dict(type="raw", no_log=False),
    context=dict(type="str"),
    host=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    validate_certs=dict(type="bool", aliases=["verify_ssl"]),
    ca_cert=dict(type="path", aliases=["ssl_ca_cert"]),
    client_cert=dict(type="path", aliases=["cert_file"]),
    client_key=dict(type="path", aliases=["key_file"]),
)
AUTH_ENV = {name: "K8S_AUTH_" + name.upper() for name in AUTH_ARG_SPEC}
DEFAULT_GPU_RESOURCES = ("nvidia.com/gpu",)
CONTAINERD_SCHEME = "containerd://"
# Labels the kubelet (through containerd's CRI plugin) puts on each container of a pod; the node-side
# steps check a container id against them before touching it.
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
# Fields of a pod the API server sets, or that tie it to its old node: left out of the spec the
# target's pod is created from.
_SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "selfLink",
                    "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences")


class KubernetesError(GpuCkptError):
    """The API server could not be reached or refused a request; nothing on the nodes was touched."""


def auth_args():
    """A fresh copy of the connection options for a module's argument_spec."""
    return copy.deepcopy(AUTH_ARG_SPEC)


def _auth_value(params, name):
    value = params.get(name)
    if value is None:
        value = os.environ.get(AUTH_ENV[name])
        if name == "validate_certs" and value is not None:
            value = value.strip().lower() not in ("0", "false", "no", "off")
    return value


def api_client(params):
    """A kubernetes ApiClient from the connection options: ``host`` (with ``api_key`` and the TLS
    files), else a kubeconfig (``kubeconfig``, a path or a dict, and ``context``; ~/.kube/config by
    default), else the pod's own service account when running in a cluster."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise KubernetesError("the kubernetes Python client is not installed where this task runs (%s)" % exc,
                              stage="preflight", hint="pip install kubernetes (the collection's EE has it)")
    p = {name: _auth_value(params, name) for name in AUTH_ARG_SPEC}
    cfg = client.Configuration()
    try:
        if p["host"]:
            cfg.host = p["host"]
            if p["api_key"]:
                cfg.api_key = {"authorization": "Bearer " + p["api_key"]}
        elif p["kubeconfig"] or p["context"] or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            if isinstance(p["kubeconfig"], dict):
                config.load_kube_config_from_dict(p["kubeconfig"], context=p["context"], client_configuration=cfg)
            else:
                path = os.path.expanduser(p["kubeconfig"]) if p["kubeconfig"] else None
                config.load_kube_config(config_file=path, context=p["context"], client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubernetesError("no usable connection to the Kubernetes API: %s" % exc, stage="preflight",
                              hint="set kubeconfig (and context), or host and api_key")
    if p["validate_certs"] is not None:
        cfg.verify_ssl = bool(p["validate_certs"])
    for option, attr in (("ca_cert", "ssl_ca_cert"), ("client_cert", "cert_file"), ("client_key", "key_file")):
        if p[option]:
            setattr(cfg, attr, p[option])
    return client.ApiClient(cfg)


def _api_error(exc, what):
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or exc.__class__.__name__
    return KubernetesError("the Kubernetes API refused %s: %s %s" % (what, status or "", reason), stage="preflight",
                           details={"api_status": status})


def read_pod(api, namespace, name):
    """The pod as the API returns it (a dict in the API's own field names), or InvalidTarget."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError
    core = client.CoreV1Api(api)
    try:
        pod = core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise InvalidTarget("there is no pod %s in namespace %s; nothing was frozen" % (name, namespace),
                                stage="preflight", hint="kubectl get pods -n %s" % namespace)
        raise _api_error(exc, "reading pod %s/%s" % (namespace, name))
    except HTTPError as exc:
        raise KubernetesError("the Kubernetes API at %s could not be reached: %s; nothing was frozen"
                              % (api.configuration.host, exc), stage="preflight")
    return api.sanitize_for_serialization(pod)


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


def describe_pod(pod, gpu_resources=DEFAULT_GPU_RESOURCES, allow_owned=False):
    """What a pod checkpoint needs to know of ``pod`` (read_pod's dict), after the refusals in the
    module doc. Raises InvalidTarget."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    where = "pod %s/%s" % (meta.get("namespace"), meta.get("name"))
    phase = status.get("phase")
    if phase != "Running":
        raise InvalidTarget("%s is %s, not Running; nothing was frozen" % (where, phase or "without a phase"),
                            stage="preflight")
    node = spec.get("nodeName")
    if not node:
        raise InvalidTarget("%s is not bound to a node; nothing was frozen" % where, stage="preflight")
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
    if owners and not allow_owned:
        o = owners[0]
        why = ("%s is owned by %s %s: once the migration deletes it, that controller would start a fresh copy of the "
               "job next to the restored one; nothing was frozen" % (where, o.get("kind"), o.get("name")))
        raise InvalidTarget(why, stage="preflight",
                            hint="orphan the pod first (kubectl delete %s %s --cascade=orphan), or set allow_owned "
                                 "once the controller will not replace it" % (str(o.get("kind")).lower(),
                                                                              o.get("name")))
    statuses = {s.get("name"): s for s in status.get("containerStatuses") or []}
    containers, by_resource = [], {}
    for c in spec.get("containers") or []:
        s = statuses.get(c.get("name"))
        if s is None or not (s.get("state") or {}).get("running"):
            state = ", ".join(sorted((s or {}).get("state") or {})) or "not started"
            raise InvalidTarget("container %s of %s is %s, not running; nothing was frozen"
                                % (c.get("name"), where, state), stage="preflight")
        cid = s.get("containerID") or ""
        if not cid.startswith(CONTAINERD_SCHEME):
            raise InvalidTarget("container %s of %s runs under %s, not containerd; only containerd's pods can be "
                                "checkpointed; nothing was frozen" % (c.get("name"), where,
                                                                      cid.split("://")[0] or "an unknown runtime"),
                                stage="preflight")
        asked = gpus_asked(c, gpu_resources)
        for name, count in asked.items():
            by_resource[name] = by_resource.get(name, 0) + count
        containers.append({"name": c.get("name"), "id": cid[len(CONTAINERD_SCHEME):], "image": c.get("image"),
                           "gpus": sum(asked.values()), "restart_count": s.get("restartCount", 0)})
    if not containers:
        raise InvalidTarget("%s has no containers; nothing was frozen" % where, stage="preflight")
    running_ephemeral = [s.get("name") for s in status.get("ephemeralContainerStatuses") or []
                         if (s.get("state") or {}).get("running")]
    claims = [c.get("name") for c in spec.get("resourceClaims") or []]
    return {"namespace": meta.get("namespace"), "name": meta.get("name"), "uid": meta.get("uid"), "node": node,
            "containers": containers, "gpu_count": sum(c["gpus"] for c in containers),
            "gpus_by_resource": by_resource, "resource_claims": claims,
            "ephemeral_containers_running": running_ephemeral, "owner": owners[0] if owners else None,
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
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError
    if node == source_node:
        raise InvalidTarget("the pod already runs on node %s; a migration needs another node; nothing was frozen" % node,
                            stage="preflight")
    try:
        n = api.sanitize_for_serialization(client.CoreV1Api(api).read_node(node))
    except ApiException as exc:
        if exc.status == 404:
            raise InvalidTarget("there is no node %s in the cluster; nothing was frozen" % node, stage="preflight",
                                hint="kubectl get nodes")
        raise _api_error(exc, "reading node %s" % node)
    except HTTPError as exc:
        raise KubernetesError("the Kubernetes API at %s could not be reached: %s; nothing was frozen"
                              % (api.configuration.host, exc), stage="preflight")
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
RESTORE_ANNOTATION = "gpuckpt.fleet/restore"
MIGRATION_ANNOTATION = "gpuckpt.fleet/migration-id"
SOURCE_NODE_ANNOTATION = "gpuckpt.fleet/source-node"
RESTORED_FROM_LABEL = "gpuckpt.fleet/restored-from"
DEFAULT_RESTORE_RUNTIME_CLASS = "gpuckpt-restore"


def target_pod_name(source_name, migration_id):
    """The default name of a migration's target pod: the source's name and a short digest of the migration id
    (the source is held, under its own name, until the target runs; a rerun of the migration finds the same
    name). Within the 63 characters of a hostname, which is what the pod's name becomes inside it."""
    import hashlib
    suffix = "-" + hashlib.sha256(str(migration_id).encode()).hexdigest()[:6]
    return source_name[:63 - len(suffix)].rstrip("-.") + suffix


def target_pod(described, target_node, name, image_dir, token, runtime_class=DEFAULT_RESTORE_RUNTIME_CLASS,
               migration_id=None):
    """The pod the restore creates: the source's recorded spec (describe_pod's ``spec``), named ``name`` (a
    second pod of the source's name cannot exist while the source is held), pinned to ``target_node``, run by
    the restore runtime class, and carrying the restore request that the node's runtime handler checks
    against the ticket the node wrote (gpuckpt_restore_runtime.py)."""
    import json
    pod = copy.deepcopy(described["spec"])
    meta, spec = pod.setdefault("metadata", {}), pod.setdefault("spec", {})
    meta["name"] = name
    meta["namespace"] = described["namespace"]
    meta.setdefault("labels", {})[RESTORED_FROM_LABEL] = described.get("uid") or ""
    meta.setdefault("annotations", {})[RESTORE_ANNOTATION] = json.dumps({"image": image_dir, "token": token})
    meta["annotations"][SOURCE_NODE_ANNOTATION] = described.get("node") or ""
    if migration_id:
        meta["annotations"][MIGRATION_ANNOTATION] = migration_id
    spec["nodeName"] = target_node  # bound by us: the scheduler is not asked, the node was checked
    spec["runtimeClassName"] = runtime_class
    return pod


def _core(api):
    from kubernetes import client
    return client.CoreV1Api(api)


def create_pod(api, pod):
    """Create ``pod``; (changed, the pod as the API returns it). A pod of that name that carries the same
    restore request is this restore's own (a rerun): not changed. Any other pod of that name is refused."""
    from kubernetes.client.exceptions import ApiException
    meta = pod["metadata"]
    try:
        made = _core(api).create_namespaced_pod(meta["namespace"], pod)
        return True, api.sanitize_for_serialization(made)
    except ApiException as exc:
        if exc.status != 409:
            raise _api_error(exc, "creating pod %s/%s" % (meta["namespace"], meta["name"]))
    there = read_pod(api, meta["namespace"], meta["name"])
    if ((there.get("metadata") or {}).get("annotations") or {}).get(RESTORE_ANNOTATION) != \
            meta["annotations"][RESTORE_ANNOTATION]:
        raise InvalidTarget("a pod %s/%s that this restore did not create already exists; nothing was restored"
                            % (meta["namespace"], meta["name"]), stage="preflight",
                            hint="name the target pod otherwise (target_pod_name)")
    return False, there


def find_pod(api, namespace, name):
    """The pod as the API returns it, or None when there is none of that name."""
    try:
        return read_pod(api, namespace, name)
    except InvalidTarget:
        return None


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


def wait_pod_gone(api, namespace, name, uid, timeout, poll=1.0):
    """Wait until the pod of ``uid`` is gone from the API server (the kubelet has stopped its containers and
    the API server removed it); a pod made since under the name does not count."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        pod = find_pod(api, namespace, name)
        if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
            return
        if time.monotonic() > deadline:
            raise GpuCkptError("pod %s/%s (uid %s) is still there %ds after its deletion (its node's kubelet has not "
                               "stopped it)" % (namespace, name, uid, timeout), stage="release-source")
        time.sleep(poll)


def delete_pod(api, namespace, name, uid, grace_period=None):
    """Delete pod ``namespace/name`` only while it is the pod of ``uid`` (the API's precondition): a pod
    made since under the same name is never deleted. ``grace_period``: seconds the kubelet gives its containers
    between SIGTERM and SIGKILL (the pod's own by default). Returns whether it was deleted now."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                  grace_period_seconds=grace_period)
    try:
        _core(api).delete_namespaced_pod(name, namespace, body=body)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        if exc.status == 409:
            raise InvalidTarget("pod %s/%s is no longer the pod %s (it was replaced); it was not deleted"
                                % (namespace, name, uid), stage="release-source")
        raise _api_error(exc, "deleting pod %s/%s" % (namespace, name))


def wait_pod_running(api, namespace, name, timeout, poll=1.0):
    """The pod once it is Running with every container running (its restored copy came up), or an error
    naming what it waits in (the kubelet's reason) after ``timeout`` seconds."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        pod = read_pod(api, namespace, name)
        status = pod.get("status") or {}
        states = [(s.get("name"), s.get("state") or {}) for s in status.get("containerStatuses") or []]
        if status.get("phase") == "Running" and states and all("running" in st for unused, st in states):
            return pod
        terminated = [(n, st["terminated"]) for n, st in states if "terminated" in st]
        if status.get("phase") in ("Failed", "Succeeded") or terminated:
            n, t = terminated[0] if terminated else (None, {})
            what = "container %s terminated" % n if terminated else "is " + status.get("phase", "")
            why = ": %s" % (t.get("reason") or t.get("message")) if t else ""
            raise GpuCkptError("pod %s/%s %s%s" % (namespace, name, what, why),
                               stage="runtime-restore")
        if time.monotonic() > deadline:
            waiting = ["%s: %s" % (n, (st.get("waiting") or {}).get("reason") or "not started") for n, st in states]
            raise GpuCkptError("pod %s/%s is not running after %ds (phase %s%s)"
                               % (namespace, name, timeout, status.get("phase"),
                                  "; " + ", ".join(waiting) if waiting else ""), stage="runtime-restore")
        time.sleep(poll)
