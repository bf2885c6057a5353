"""A Kubernetes node as a drain reads it (its free GPUs, its GPU pods) and its cordon, through the real
``kubernetes`` Python client talking over HTTP to the API server TEST DOUBLE (tests/k8s_apiserver_double.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import api as k8s_api  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import nodes as k8s_nodes  # noqa: E402


def pod(name, node="node-a", gpus=1, phase="Running", owner=None, cid=None, namespace="ml"):
    meta = {"name": name, "namespace": namespace}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": owner, "name": "train", "uid": "u-1", "controller": True}]
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {"metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "img", "resources": resources}]},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "main", "containerID": "containerd://" + (cid or name + "-id"), "restartCount": 0, "image": "img",
                 "imageID": "sha256:" + "0" * 64, "ready": True,
                 "state": {"running": {"startedAt": "2026-11-25T10:00:00Z"}}}]}}


@pytest.fixture
def api(tmp_path):
    double = ApiServerDouble().start()
    double.add_node("node-a", gpus=4)
    double.kubeconfig(str(tmp_path / "kubeconfig"))
    yield double, k8s_api.api_client({"kubeconfig": str(tmp_path / "kubeconfig")})
    double.stop()


def test_free_gpus_are_allocatable_less_what_live_pods_ask_and_gpu_pods_are_found(api):
    double, client = api
    double.add_pod(pod("trainer", gpus=2))
    double.add_pod(pod("done", gpus=1, phase="Succeeded"))  # an ended pod holds nothing
    double.add_pod(pod("web", gpus=0))  # no GPU: not a GPU pod
    double.add_pod(pod("cdi", gpus=0, cid="cdi-ctr"))  # asks no GPU resource, but holds CUDA (CDI)
    double.add_pod(pod("owned", gpus=1, owner="Job"))
    double.add_pod(pod("elsewhere", node="node-b", gpus=1))
    node, pods = k8s_nodes.read(client, "node-a", cuda_containers=["cdi-ctr"])
    assert node["ready"] and not node["unschedulable"] and node["cordoned_by"] is None
    assert node["gpus_allocatable"] == {"nvidia.com/gpu": 4}
    assert node["gpus_requested"] == {"nvidia.com/gpu": 3} and node["gpus_free"] == {"nvidia.com/gpu": 1}
    assert [p["pod"] for p in pods] == ["ml/cdi", "ml/owned", "ml/trainer"]
    by = {p["name"]: p for p in pods}
    assert by["owned"]["owner"] == {"kind": "Job", "name": "train"} and by["owned"]["refused"] is None
    assert by["trainer"]["containers"] == ["trainer-id"] and by["trainer"]["gpu_count"] == 2


def test_a_pod_that_cannot_move_says_why(api):
    double, client = api
    p = pod("crashing")
    p["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    double.add_pod(p)
    unused, pods = k8s_nodes.read(client, "node-a")
    assert "not running" in pods[0]["refused"]


def test_a_drain_cordons_once_and_uncordons_only_its_own_cordon(api):
    double, client = api
    node, unused = k8s_nodes.read(client, "node-a")
    patch = k8s_nodes.cordon_patch(node, True, "drain-1")
    k8s_nodes.patch_node(client, "node-a", patch)
    node, unused = k8s_nodes.read(client, "node-a")
    assert node["unschedulable"] and node["cordoned_by"] == "drain-1"
    assert k8s_nodes.cordon_patch(node, True, "drain-2") is None  # a re-run changes nothing
    k8s_nodes.patch_node(client, "node-a", k8s_nodes.cordon_patch(node, False, "drain-1"))
    node, unused = k8s_nodes.read(client, "node-a")
    assert not node["unschedulable"] and node["cordoned_by"] is None
    # an operator's own cordon: never marked as ours, never taken back
    k8s_nodes.patch_node(client, "node-a", {"spec": {"unschedulable": True}})
    node, unused = k8s_nodes.read(client, "node-a")
    assert k8s_nodes.cordon_patch(node, True, "drain-3") is None
    assert k8s_nodes.cordon_patch(node, False, "drain-3") is None
