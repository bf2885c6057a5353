"""A Kubernetes pod found by the collection: the real ``kubernetes`` client in gpu_pod_info talks over
HTTP to the API server TEST DOUBLE (tests/k8s_apiserver_double.py: none can be installed here), whose
pod names two containers that real containerd 2.1.9 runs in namespace k8s.io with the labels the
kubelet gives them; the node side then finds each container's process tree by the id the API gave."""
from __future__ import annotations

import json
import os
import sys
import uuid

import pytest

from containerd_daemon import Containerd, available
from helpers import MANAGED_PYTHON, REPO
from test_containerd import ContainerdWorkload

sys.path.insert(0, os.path.join(REPO, "tests"))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402

POD_INFO = os.path.join(REPO, "tests", "integration", "playbooks", "pod_info.yml")
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and python3-grpcio (tests/setup.sh) needed")


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    daemon = Containerd(str(tmp_path_factory.mktemp("containerd"))).start()
    daemon.import_skeleton(namespace="k8s.io")
    yield daemon
    daemon.stop()


@pytest.fixture
def cluster(tmp_path, fakecuda, containerd):
    """The API double with nodes node-a (2 GPUs) and node-b (2 GPUs), and pod default/gpu-test-pod on
    node-a: containers trainer (2 GPUs) and logger, each a real containerd task in k8s.io."""
    api = ApiServerDouble().start()
    api.add_node("node-a", gpus=2)
    api.add_node("node-b", gpus=2)
    uid = str(uuid.uuid4())
    made = {}
    for name in ("trainer", "logger"):
        labels = {"io.kubernetes.pod.name": "gpu-test-pod", "io.kubernetes.pod.namespace": "default",
                  "io.kubernetes.pod.uid": uid, "io.kubernetes.container.name": name,
                  "io.cri-containerd.kind": "container"}
        made[name] = ContainerdWorkload(containerd, str(tmp_path / name), fakecuda, "k8s.io", labels=labels,
                                        cid=uuid.uuid4().hex + uuid.uuid4().hex)
    api.add_pod({"metadata": {"name": "gpu-test-pod", "namespace": "default", "uid": uid},
                 "spec": {"nodeName": "node-a", "containers": [
                     {"name": "trainer", "image": "localhost/gpuckpt-skel:1",
                      "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                     {"name": "logger", "image": "localhost/gpuckpt-skel:1"}]},
                 "status": {"phase": "Running", "containerStatuses": [
                     {"name": n, "containerID": "containerd://" + w.id, "image": "localhost/gpuckpt-skel:1",
                      "imageID": "sha256:" + "0" * 64, "ready": True, "restartCount": 0,
                      "state": {"running": {"startedAt": "2026-11-23T10:00:00Z"}}} for n, w in made.items()]}})
    inventory = tmp_path / "inventory.yml"
    node = {"ansible_connection": "local", "ansible_python_interpreter": MANAGED_PYTHON}
    inventory.write_text(json.dumps({"all": {"hosts": {
        "localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "gpu1": dict(node, gpuckpt_k8s_node_name="node-a"), "gpu2": dict(node, gpuckpt_k8s_node_name="node-b")}}}))
    yield {"api": api, "containers": made, "inventory": str(inventory),
           "kubeconfig": api.kubeconfig(str(tmp_path / "kubeconfig")), "address": containerd.address}
    api.stop()
    containerd.remove_all()


def run(playbook, cluster, **pod_args):
    args = dict({"namespace": "default", "name": "gpu-test-pod", "kubeconfig": cluster["kubeconfig"]}, **pod_args)
    return playbook(POD_INFO, {"pod_args": args, "containerd_address": cluster["address"]},
                    inventory=cluster["inventory"], interpreter=None)


def test_a_pods_containers_are_found_on_its_node_by_the_ids_the_api_gives(playbook, cluster):
    r = run(playbook, cluster, target_node="node-b", gpu_count=2)
    assert r.rc == 0, r.stdout
    pod = r.task("Ask the API server")["pod"]
    assert pod["node"] == "node-a" and pod["gpu_count"] == 2
    assert [c["name"] for c in pod["containers"]] == ["trainer", "logger"]
    trees = [res for res in r.results if res["_task"] == "Each container's process tree"]
    assert [t["_host"] for t in trees] == ["gpu1"], trees  # the node mapped to its inventory host
    for item in trees[0]["results"]:
        w = cluster["containers"][item["item"]["name"]]
        facts = item["ansible_facts"]["gpuckpt"]
        assert facts["container"]["id"] == w.id
        assert sorted(facts["tree"]["pids"]) == sorted(w.host_pids())
        assert facts["tree"]["cuda_pids"], facts["tree"]  # each holds CUDA processes (the libcuda double)
    assert {req[0] for req in cluster["api"].requests} == {"GET"}  # found, nothing changed


@pytest.mark.parametrize("args, says", [
    ({"gpu_count": 1}, "holds 2 GPU(s); it cannot be restored onto 1"),
    ({"target_node": "node-a"}, "already runs on node node-a"),
    ({"name": "no-such-pod"}, "there is no pod no-such-pod in namespace default"),
])
def test_what_cannot_move_is_refused_before_anything_is_frozen(playbook, cluster, args, says):
    before = {n: w.counts() for n, w in cluster["containers"].items()}
    r = run(playbook, cluster, **args)
    assert r.rc != 0 and says in r.stdout, r.stdout
    assert "nothing was frozen" in r.stdout
    for n, w in cluster["containers"].items():  # both containers count on, intact, never frozen
        w.went_on_intact(before[n])
        assert w.task()["status"] == "RUNNING"
    assert {req[0] for req in cluster["api"].requests} == {"GET"}
