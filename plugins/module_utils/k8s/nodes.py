# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Kubernetes node as a drain sees it: whether pods may land on it (Ready, not cordoned, GPUs free), the GPU
pods bound to it, and its cordon.

The GPUs a node has free are its allocatable count of each GPU resource less what the pods bound to it and
not ended ask for (the scheduler's own sum, limits where set, else requests): the device plugin then picks
which GPUs. A drain cordons its node (``spec.unschedulable``, as ``kubectl cordon``) with an annotation that
says the collection did it, and uncordons only a node that carries that annotation: a node an operator
cordoned for reasons of their own stays cordoned.

The reads are pure functions of the API's objects (dicts in the API's field names); the calls to the API
server are the three functions at the end.
"""
from __future__ import annotations

from ..core.errors import InvalidTarget
from .api import api_error, core_api, read_node
from .pods import DEFAULT_GPU_RESOURCES, CONTAINERD_SCHEME, describe_pod, gpus_asked

CORDONED_BY_ANNOTATION = "gpuckpt.fleet/cordoned-by"
ENDED_PHASES = ("Succeeded", "Failed")


def _count(value):
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def pod_gpus(pod, resources=DEFAULT_GPU_RESOURCES):
    """{resource: GPUs} that a pod's containers ask for together (a resource none asks for is left out)."""
    out = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        try:
            asked = gpus_asked(c, resources)
        except InvalidTarget:
            continue  # not a whole number: describe_pod refuses the pod itself, with the reason
        for name, n in asked.items():
            out[name] = out.get(name, 0) + n
    return out


def _ended(pod):
    return (pod.get("status") or {}).get("phase") in ENDED_PHASES


def describe_node(node, pods_on_node, resources=DEFAULT_GPU_RESOURCES):
    """{name, ready, unschedulable, cordoned_by, gpus_allocatable, gpus_requested, gpus_free} of ``node`` (the API's
    Node) with the pods bound to it (``pods_on_node``)."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    allocatable = {r: _count(v) for r, v in (status.get("allocatable") or {}).items() if r in resources}
    requested = {}
    for pod in pods_on_node:
        if not _ended(pod):
            for r, n in pod_gpus(pod, resources).items():
                requested[r] = requested.get(r, 0) + n
    return {"name": meta.get("name"), "ready": conditions.get("Ready") == "True",
            "unschedulable": bool(spec.get("unschedulable")),
            "cordoned_by": (meta.get("annotations") or {}).get(CORDONED_BY_ANNOTATION),
            "gpus_allocatable": allocatable, "gpus_requested": requested,
            "gpus_free": {r: max(0, n - requested.get(r, 0)) for r, n in allocatable.items()}}


def _containerd_ids(pod):
    return [s["containerID"][len(CONTAINERD_SCHEME):] for s in (pod.get("status") or {}).get("containerStatuses") or []
            if str(s.get("containerID") or "").startswith(CONTAINERD_SCHEME)]


def _refusal(pod, resources):
    """Why the pod cannot move whatever its target (describe_pod's refusals, a controller apart: whether an owned
    pod may move is the drain's option), or None."""
    try:
        describe_pod(pod, resources, allow_owned=True)
    except InvalidTarget as exc:
        return exc.msg
    return None


def gpu_pods(pods_on_node, resources=DEFAULT_GPU_RESOURCES, cuda_containers=()):
    """The pods of ``pods_on_node`` that are GPU work: those that ask for a GPU resource, and those with a container
    among ``cuda_containers`` (containerd ids whose processes hold CUDA contexts: a pod given its GPU otherwise, by
    CDI or a privileged mount). Each: {pod, namespace, name, uid, phase, gpus_by_resource, gpu_count, containers,
    owner, refused}."""
    cuda = set(cuda_containers or ())
    out = []
    for pod in pods_on_node:
        if _ended(pod):
            continue
        gpus, ids = pod_gpus(pod, resources), _containerd_ids(pod)
        if not (sum(gpus.values()) or cuda.intersection(ids)):
            continue
        meta = pod.get("metadata") or {}
        owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
        out.append({"pod": "%s/%s" % (meta.get("namespace"), meta.get("name")), "namespace": meta.get("namespace"),
                    "name": meta.get("name"), "uid": meta.get("uid"), "phase": (pod.get("status") or {}).get("phase"),
                    "gpus_by_resource": gpus, "gpu_count": sum(gpus.values()), "containers": ids,
                    "owner": {"kind": owners[0].get("kind"), "name": owners[0].get("name")} if owners else None,
                    "refused": _refusal(pod, resources)})
    return sorted(out, key=lambda p: p["pod"])


def cordon_patch(node_summary, cordon, by):
    """The merge patch that cordons (``cordon``) or uncordons the node, or None when there is nothing to do: a node
    already cordoned is left as it is (and is not marked as ours), and only a cordon of ours is taken back."""
    if cordon:
        if node_summary["unschedulable"]:
            return None
        return {"spec": {"unschedulable": True}, "metadata": {"annotations": {CORDONED_BY_ANNOTATION: by}}}
    if not node_summary["cordoned_by"]:
        return None
    return {"spec": {"unschedulable": None}, "metadata": {"annotations": {CORDONED_BY_ANNOTATION: None}}}


# ---- the API server ----------------------------------------------------------------------------------------
def list_pods_on_node(api, node):
    """The pods bound to ``node``, of every namespace, as the API returns them (dicts)."""
    from kubernetes.client.exceptions import ApiException
    try:
        listed = core_api(api).list_pod_for_all_namespaces(field_selector="spec.nodeName=%s" % node)
    except ApiException as exc:
        raise api_error(exc, "listing the pods of node %s" % node)
    return api.sanitize_for_serialization(listed).get("items") or []


def read(api, node, resources=DEFAULT_GPU_RESOURCES, cuda_containers=()):
    """(describe_node's summary, gpu_pods) of ``node``, read from the API server."""
    pods = list_pods_on_node(api, node)
    return describe_node(read_node(api, node), pods, resources), gpu_pods(pods, resources, cuda_containers)


def patch_node(api, node, patch):
    """Apply a merge patch to ``node``."""
    from kubernetes.client.exceptions import ApiException
    try:
        core_api(api).patch_node(node, patch, _content_type="application/merge-patch+json")
    except ApiException as exc:
        change = "cordon" if (patch.get("spec") or {}).get("unschedulable") else "uncordon"
        raise api_error(exc, "changing node %s (%s)" % (node, change))
