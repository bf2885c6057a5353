"""A pod found and described through the real ``kubernetes`` Python client, talking over HTTP to the
API server TEST DOUBLE (tests/k8s_apiserver_double.py), and the refusals that come before any freeze."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import api as k8s_api  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import pods as k8s_pods  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import waits as k8s_waits  # noqa: E402

IDS = {"trainer": "a1" * 32, "logger": "b2" * 32}


def gpu_pod(name="gpu-test-pod", gpus=2, phase="Running", owner=None, scheme="containerd://", running=True):
    meta = {"name": name, "namespace": "default", "labels": {"app": "train"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": owner, "name": "train-job", "uid": "u-1",
                                    "controller": True}]
    return {"metadata": meta,
            "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": "pytorch:24.08", "command": ["python", "train.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}},
                                    {"name": "logger", "image": "busybox:1", "command": ["sh"]}]},
            "status": {"phase": phase, "containerStatuses": [
                {"name": c, "containerID": scheme + IDS[c], "image": "img", "imageID": "sha256:" + "0" * 64,
                 "ready": True, "restartCount": 0,
                 "state": {"running": {"startedAt": "2026-11-23T10:00:00Z"}} if running else
                 {"waiting": {"reason": "CrashLoopBackOff"}}} for c in ("trainer", "logger")]}}


@pytest.fixture
def api(tmp_path):
    double = ApiServerDouble().start()
    double.add_node("node-a", gpus=2)
    double.add_node("node-b", gpus=2)
    double.add_node("node-small", gpus=1)
    double.add_node("node-down", gpus=2, ready=False)
    double.kubeconfig(str(tmp_path / "kubeconfig"))
    yield double
    double.stop()


def client(api, tmp_path, **params):
    params.setdefault("kubeconfig", str(tmp_path / "kubeconfig"))
    return k8s_api.api_client(params)


def test_a_running_pod_is_described_with_its_containerd_ids_and_gpus(api, tmp_path):
    api.add_pod(gpu_pod())
    d = k8s_pods.describe_pod(k8s_api.read_pod(client(api, tmp_path), "default", "gpu-test-pod"))
    assert d["node"] == "node-a" and d["gpu_count"] == 2 and d["gpus_by_resource"] == {"nvidia.com/gpu": 2}
    assert [(c["name"], c["id"], c["gpus"]) for c in d["containers"]] == [("trainer", IDS["trainer"], 2),
                                                                          ("logger", IDS["logger"], 0)]
    spec = d["spec"]
    assert "nodeName" not in spec["spec"] and "uid" not in spec["metadata"]
    assert "resourceVersion" not in spec["metadata"] and spec["metadata"]["labels"] == {"app": "train"}
    assert api.requests == [("GET", "/api/v1/namespaces/default/pods/gpu-test-pod")]


def test_the_connection_by_host_and_token_and_a_wrong_token(api, tmp_path):
    api.add_pod(gpu_pod())
    good = k8s_api.api_client({"host": api.url, "api_key": api.token})
    assert k8s_api.read_pod(good, "default", "gpu-test-pod")["metadata"]["name"] == "gpu-test-pod"
    bad = k8s_api.api_client({"host": api.url, "api_key": "not-it"})
    with pytest.raises(k8s_api.KubernetesError, match="401"):
        k8s_api.read_pod(bad, "default", "gpu-test-pod")


def test_the_environment_gives_the_connection_as_kubernetes_core_reads_it(api, tmp_path, monkeypatch):
    api.add_pod(gpu_pod())
    monkeypatch.setenv("K8S_AUTH_HOST", api.url)
    monkeypatch.setenv("K8S_AUTH_API_KEY", api.token)
    assert k8s_api.read_pod(k8s_api.api_client({}), "default", "gpu-test-pod")["spec"]["nodeName"] == "node-a"


def test_impersonation_reaches_the_api_server_one_header_per_group(api, tmp_path):
    """The API server takes each impersonated group from its own Impersonate-Group header, never a joined list."""
    api.add_pod(gpu_pod())
    as_alice = k8s_api.api_client({"host": api.url, "api_key": api.token, "impersonate_user": "alice",
                                   "impersonate_groups": ["ops", "gpu-admins"]})
    k8s_api.read_pod(as_alice, "default", "gpu-test-pod")
    headers = [(name.lower(), value) for name, value in api.request_headers[-1]]
    assert [v for n, v in headers if n == "impersonate-user"] == ["alice"]
    assert [v for n, v in headers if n == "impersonate-group"] == ["ops", "gpu-admins"]


def test_an_unreachable_api_server_is_a_clear_error(tmp_path):
    api = k8s_api.api_client({"host": "http://127.0.0.1:9"})
    api.configuration.retries = 0
    with pytest.raises(k8s_api.KubernetesError, match="could not be reached"):
        k8s_api.read_pod(api, "default", "x")


@pytest.mark.parametrize("pod, says", [
    (None, "there is no pod gpu-test-pod in namespace default"),
    (gpu_pod(phase="Pending"), "is Pending, not Running"),
    (gpu_pod(running=False), "container trainer of pod default/gpu-test-pod is waiting, not running"),
    (gpu_pod(scheme="cri-o://"), "runs under cri-o, not containerd"),
    (gpu_pod(owner="Job"), "owned by Job train-job"),
])
def test_what_cannot_move_is_refused_with_its_reason(api, tmp_path, pod, says):
    if pod:
        api.add_pod(pod)
    with pytest.raises(InvalidTarget, match=says) as exc:
        k8s_pods.describe_pod(k8s_api.read_pod(client(api, tmp_path), "default", "gpu-test-pod"))
    assert "nothing was frozen" in exc.value.msg


def test_an_owned_pod_passes_when_allowed_and_names_its_owner(api, tmp_path):
    api.add_pod(gpu_pod(owner="Job"))
    d = k8s_pods.describe_pod(k8s_api.read_pod(client(api, tmp_path), "default", "gpu-test-pod"), allow_owned=True)
    assert d["owner"]["kind"] == "Job"


def test_another_gpu_count_is_refused_and_the_same_count_passes():
    d = k8s_pods.describe_pod(dict(gpu_pod(gpus=2), metadata={"name": "p", "namespace": "default"}))
    k8s_pods.check_gpu_count(d, 2)
    k8s_pods.check_gpu_count(d, None)
    with pytest.raises(InvalidTarget, match="holds 2 GPU.*cannot be restored onto 1.*one-to-one"):
        k8s_pods.check_gpu_count(d, 1)
    with pytest.raises(InvalidTarget, match="whole number"):
        k8s_pods.describe_pod(gpu_pod(gpus="1.5"))


@pytest.mark.parametrize("node, says", [
    ("node-a", "already runs on node node-a"),
    ("node-x", "there is no node node-x"),
    ("node-down", "not Ready"),
    ("node-small", "offers 1 of nvidia.com/gpu; pod default/gpu-test-pod needs 2"),
])
def test_a_target_node_that_cannot_take_the_pod_is_refused(api, tmp_path, node, says):
    api.add_pod(gpu_pod())
    c = client(api, tmp_path)
    d = k8s_pods.describe_pod(k8s_api.read_pod(c, "default", "gpu-test-pod"))
    with pytest.raises(InvalidTarget, match=says):
        k8s_pods.check_target_gpus(d, k8s_pods.check_target_node(c, node, d["node"]))
    t = k8s_pods.check_target_node(c, "node-b", d["node"])
    k8s_pods.check_target_gpus(d, t)
    assert t["ready"] and t["allocatable"] == {"nvidia.com/gpu": "2"}


def test_the_inventory_host_of_a_node():
    hostvars = {"gpu1": {"gpuckpt_k8s_node_name": "node-a"}, "node-b": {}, "x": {"gpuckpt_k8s_node_name": "node-c"},
                "y": {"gpuckpt_k8s_node_name": "node-c"}}
    hosts = list(hostvars)
    assert k8s_pods.inventory_host_for_node("node-a", hostvars, hosts) == "gpu1"
    assert k8s_pods.inventory_host_for_node("node-b", hostvars, hosts) == "node-b"
    with pytest.raises(ValueError, match="none of the inventory's hosts is Kubernetes node node-z"):
        k8s_pods.inventory_host_for_node("node-z", hostvars, hosts)
    with pytest.raises(ValueError, match="2 of the inventory's hosts are Kubernetes node node-c"):
        k8s_pods.inventory_host_for_node("node-c", hostvars, hosts)


def test_a_kubeconfig_given_as_a_dict_and_its_context(api, tmp_path):
    api.add_pod(gpu_pod())
    with open(str(tmp_path / "kubeconfig")) as fh:
        doc = json.load(fh)
    c = k8s_api.api_client({"kubeconfig": doc, "context": "gpuckpt-test"})
    assert k8s_api.read_pod(c, "default", "gpu-test-pod")["spec"]["nodeName"] == "node-a"
    with pytest.raises(k8s_api.KubernetesError, match="no usable connection"):
        k8s_api.api_client({"kubeconfig": doc, "context": "no-such-context"})


# ---- the target pod of a restore, and the source pod's end ------------------------------------------------
def test_the_target_pod_is_the_source_spec_pinned_to_its_node_with_the_restore_request(api, tmp_path):
    api.add_pod(gpu_pod())
    k = client(api, tmp_path)
    d = k8s_pods.describe_pod(k8s_api.read_pod(k, "default", "gpu-test-pod"))
    pod = k8s_pods.target_pod(d, "node-b", "gpu-test-pod-b", "/var/lib/gpuckpt/images/m1", "t0k")
    assert pod["spec"]["nodeName"] == "node-b" and pod["spec"]["runtimeClassName"] == "gpuckpt-restore"
    assert pod["spec"]["containers"] == d["spec"]["spec"]["containers"]  # the same containers, GPUs asked the same
    assert json.loads(pod["metadata"]["annotations"]["gpuckpt.fleet/restore"]) == {
        "image": "/var/lib/gpuckpt/images/m1", "token": "t0k"}
    assert pod["metadata"]["labels"] == {"app": "train", "gpuckpt.fleet/restored-from": d["uid"]}
    assert "nodeName" not in d["spec"]["spec"]  # the description is not changed

    assert k8s_pods.create_pod(k, pod)[0] is True
    made = api.pod("default", "gpu-test-pod-b")
    assert made["spec"]["nodeName"] == "node-b" and made["metadata"]["uid"] != d["uid"]
    assert k8s_pods.create_pod(k, pod)[0] is False  # a rerun: the same restore's pod, not changed
    other = k8s_pods.target_pod(d, "node-b", "gpu-test-pod-b", "/var/lib/gpuckpt/images/m2", "x")
    with pytest.raises(InvalidTarget, match="that this restore did not create already exists"):
        k8s_pods.create_pod(k, other)


def test_the_source_pod_is_deleted_only_while_it_is_the_same_pod(api, tmp_path):
    api.add_pod(gpu_pod())
    k = client(api, tmp_path)
    uid = api.pod("default", "gpu-test-pod")["metadata"]["uid"]
    with pytest.raises(InvalidTarget, match="no longer the pod"):  # a pod of the same name made since
        k8s_pods.delete_pod(k, "default", "gpu-test-pod", "another-uid")
    assert api.pod("default", "gpu-test-pod") is not None
    assert k8s_pods.delete_pod(k, "default", "gpu-test-pod", uid) is True
    assert api.pod("default", "gpu-test-pod") is None
    assert k8s_pods.delete_pod(k, "default", "gpu-test-pod", uid) is False  # gone already: not changed


def test_waiting_for_the_target_pod_names_what_it_waits_in(api, tmp_path):
    api.add_pod(gpu_pod())
    k = client(api, tmp_path)
    assert k8s_waits.wait_pod_running(k, "default", "gpu-test-pod", 5)["status"]["phase"] == "Running"
    api.add_pod(gpu_pod(name="stuck", phase="Pending", running=False))
    with pytest.raises(GpuCkptError, match="is not running after 0s"):
        k8s_waits.wait_pod_running(k, "default", "stuck", 0)
