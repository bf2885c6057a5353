"""A Kubernetes node's drain plan: its pods (one workload each, from the kubelet's labels on the node) joined with
what the API server says of them (gpu_k8s_node's results), placed only on Ready, schedulable nodes with their
GPUs free, one pod's GPUs reserved before the next is placed."""
from __future__ import annotations

from test_filters_drain import ROOT, host, registered, workload

from ansible_collections.gpuckpt.fleet.plugins.filter.drain_plan import drain_plan


def pod_workload(name, gpu_gib, pid, uid=None):
    w = workload("k8s_pod:ml/" + name, gpu_gib, pid)
    w.update(kind="pod", runtime="k8s_pod", pod="ml/" + name, pod_uid=uid or "uid-" + name, containers=[name + "-c"])
    return w


def api_pod(name, gpus=1, owner=None, refused=None, uid=None):
    return {"pod": "ml/" + name, "namespace": "ml", "name": name, "uid": uid or "uid-" + name, "phase": "Running",
            "gpus_by_resource": {"nvidia.com/gpu": gpus}, "gpu_count": gpus, "containers": [name + "-c"],
            "owner": owner, "refused": refused}


def k8s_node(name, free=2, ready=True, unschedulable=False):
    return {"changed": False, "gpu_pods": [], "left_cordoned": None,
            "node": {"name": name, "ready": ready, "unschedulable": unschedulable, "cordoned_by": None,
                     "gpus_allocatable": {"nvidia.com/gpu": 8}, "gpus_requested": {"nvidia.com/gpu": 8 - free},
                     "gpus_free": {"nvidia.com/gpu": free}}}


def plan(workloads, pods, nodes, targets=("hostb", "hostc"), **kw):
    node = dict(host("node", runtimes=("containerd",)), workloads=workloads)
    return drain_plan(node, targets={t: registered(host(t, runtimes=("containerd",))) for t in targets}, node="node",
                      source_path=ROOT, target_paths={t: ROOT for t in targets}, id_prefix="drain-node-1",
                      k8s_pods=pods, k8s_nodes=nodes, **kw)


def test_pods_go_to_nodes_with_their_gpus_free_and_reserve_them():
    p = plan([pod_workload("a", 10, 100), pod_workload("b", 5, 200)],
             {"changed": False, "gpu_pods": [api_pod("a", gpus=2), api_pod("b", gpus=2), api_pod("idle", gpus=1)]},
             {"hostb": k8s_node("node-b", free=2), "hostc": k8s_node("node-c", free=3)})
    # a (the larger) takes node-c's 3 free GPUs down to 1 (placed on the most free GPU memory first: both equal, so by
    # name, hostb) - whichever it takes, b must go to the other node: no node has 4 free.
    targets = {m["workload"]["pod"]: m["target"] for m in p["moves"]}
    assert sorted(targets) == ["ml/a", "ml/b"] and targets["ml/a"] != targets["ml/b"]
    assert [w["pod"] for w in p["left_out"]] == ["ml/idle"] and "holds a CUDA context" in p["left_out"][0]["reason"]
    assert any(line.startswith("  MOVE  pod ml/a") for line in p["lines"])


def test_a_pod_stays_where_no_node_can_take_it_and_says_why():
    p = plan([pod_workload("a", 10, 100)], {"gpu_pods": [api_pod("a", gpus=4)]},
             {"hostb": k8s_node("node-b", free=8, ready=False), "hostc": k8s_node("node-c", free=8, unschedulable=True)},
             targets=("hostb", "hostc", "hostd"))
    assert p["moves"] == []
    rejected = p["stays"][0]["rejected"]
    assert "node node-b is not Ready" in rejected["hostb"]
    assert "node node-c is cordoned" in rejected["hostc"]
    assert "hostd is no Kubernetes node the API server answered for (not asked)" in rejected["hostd"]
    p = plan([pod_workload("a", 10, 100)], {"gpu_pods": [api_pod("a", gpus=4)]}, {"hostb": k8s_node("node-b", free=2)},
             targets=("hostb",))
    assert "nvidia.com/gpu 2 free, pod needs 4" in p["stays"][0]["rejected"]["hostb"]


def test_pods_that_cannot_move_anywhere_stay_with_the_api_servers_reason():
    nodes = {"hostb": k8s_node("node-b", free=8)}
    workloads = [pod_workload("owned", 1, 100), pod_workload("crash", 1, 200), pod_workload("gone", 1, 300),
                 pod_workload("replaced", 1, 400)]
    pods = {"gpu_pods": [api_pod("owned", owner={"kind": "Job", "name": "train"}),
                         api_pod("crash", refused="container main of pod ml/crash is waiting, not running"),
                         api_pod("replaced", uid="another-uid")]}
    reasons = {s["workload"]["pod"]: s["reason"] for s in plan(workloads, pods, nodes, targets=("hostb",))["stays"]}
    assert "owned by Job train" in reasons["ml/owned"] and "gpuckpt_allow_owned" in reasons["ml/owned"]
    assert "waiting, not running" in reasons["ml/crash"]
    assert "shows no pod ml/gone" in reasons["ml/gone"] and "shows no pod ml/replaced" in reasons["ml/replaced"]
    p = plan(workloads[:1], pods, nodes, targets=("hostb",), allow_owned=True)
    assert [m["workload"]["pod"] for m in p["moves"]] == ["ml/owned"]
    # the API server not read: every pod stays, saying so; other workloads are planned as ever
    p = plan([pod_workload("a", 1, 100), workload("runc:web", 1, 500)],
             {"failed": True, "msg": "Unauthorized"}, nodes, targets=("hostb",))
    assert [m["workload"]["key"] for m in p["moves"]] == []  # runc is not on the targets of this test
    assert "API server was not read" in p["stays"][0]["reason"] and "Unauthorized" in p["stays"][0]["reason"]
