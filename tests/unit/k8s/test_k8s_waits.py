"""The controller's waits on a pod (k8s/waits.py), against the API server TEST DOUBLE through the real
``kubernetes`` client: a migration's target pod until it runs, a deleted source pod until its kubelet let it go."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import api_client  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.pods import delete_pod  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.waits import wait_pod_gone, wait_pod_running  # noqa: E402


def pod(name, node="node-a", phase="Running", state=None):
    status = {"name": "trainer", "image": "pytorch:24.08", "imageID": "sha256:" + "0" * 64, "ready": True,
              "restartCount": 0, "state": state if state is not None else {"running": {"startedAt": "2026-11-23T10:00:00Z"}}}
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "pytorch:24.08"}]},
            "status": {"phase": phase, "containerStatuses": [status]}}


@pytest.fixture
def api(tmp_path):
    double = ApiServerDouble().start()
    double.graceful_nodes.add("node-a")  # its pods stay, being deleted, until the (stand-in) kubelet stops them
    yield double, api_client({"host": double.url, "api_key": double.token})
    double.stop()


def later(seconds, fn, *args):
    timer = threading.Timer(seconds, fn, args)
    timer.start()
    return timer


def test_a_deleted_pod_is_waited_for_until_its_kubelet_has_stopped_it(api):
    double, k = api
    uid = double.add_pod(pod("src"))["metadata"]["uid"]
    assert delete_pod(k, "default", "src", uid, grace_period=1) is True
    with pytest.raises(GpuCkptError, match=r"pod default/src \(uid %s\) is still there 0s after its deletion" % uid):
        wait_pod_gone(k, "default", "src", uid, 0, poll=0.05)
    timer = later(0.3, double.finalize, "default", "src", uid)
    wait_pod_gone(k, "default", "src", uid, 10, poll=0.05)
    timer.join()
    assert double.pod("default", "src") is None


def test_a_pod_made_since_under_the_same_name_is_not_waited_for(api):
    double, k = api
    double.add_pod(pod("src", node="node-b"))  # another pod of that name (a new uid)
    started = time.monotonic()
    wait_pod_gone(k, "default", "src", "the-old-uid", 10, poll=0.05)
    assert time.monotonic() - started < 5


def test_the_target_pod_is_waited_for_until_its_restored_containers_run(api):
    double, k = api
    double.add_pod(pod("tgt", phase="Pending", state={"waiting": {"reason": "ContainerCreating"}}))
    with pytest.raises(GpuCkptError, match=r"pod default/tgt is not running after 0s \(phase Pending; "
                                           r"trainer: ContainerCreating\)"):
        wait_pod_running(k, "default", "tgt", 0, poll=0.05)
    timer = later(0.3, double.set_status, "default", "tgt", pod("tgt")["status"])
    assert wait_pod_running(k, "default", "tgt", 10, poll=0.05)["status"]["phase"] == "Running"
    timer.join()


def test_a_target_pod_whose_container_terminated_fails_at_once_with_the_reason(api):
    double, k = api
    double.add_pod(pod("tgt", state={"terminated": {"reason": "Error", "exitCode": 1}}))
    started = time.monotonic()
    with pytest.raises(GpuCkptError, match="pod default/tgt container trainer terminated: Error"):
        wait_pod_running(k, "default", "tgt", 60, poll=0.05)
    assert time.monotonic() - started < 30
