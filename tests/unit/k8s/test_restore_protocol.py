"""The restore protocol as both of its sides speak it: the node's restore (runtimes/k8s_pod.py) and the runtime
handler as the role installs it (the program bundled from k8s/restore_protocol.py and the handler's code).
A ticket admits only its pod with its token; each container is restored once; a node restore that gives up
stops every restore of the pod, even one that finishes after it gave up."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import pods, restore_protocol
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import k8s_pod

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                      "roles", "nvidia_container_runtime", "files", "gpuckpt_restore_runtime.py")


@pytest.fixture(scope="module")
def handler():
    with open(SOURCE) as fh:
        program = handler_program(fh.read())
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpuckpt_restore_runtime", loader=None))
    meta_path = list(sys.meta_path)
    exec(compile(program, "gpuckpt_restore_runtime.py", "exec"), mod.__dict__)
    sys.meta_path[:] = meta_path  # the program's importer is its own; this process imports the package itself
    return mod


@pytest.fixture
def image(tmp_path):
    """A pod image with two containers, its ticket written by the node's restore for default/p-b."""
    image = tmp_path / "images" / "m1"
    for name in ("trainer", "logger"):
        os.makedirs(k8s_pod.container_dir(str(image), name), mode=0o700)
    k8s_pod.write_restore_ticket(str(image), "default/p-b", "t0k",
                                 [{"name": "trainer", "auto_flags": ["--link-remap"]}, {"name": "logger"}])
    return str(image)


def test_the_nodes_ticket_admits_only_its_pod_with_its_token(handler, image):
    ticket = handler.read_ticket(image, "default/p-b", "t0k")
    assert [c["name"] for c in ticket["containers"]] == ["trainer", "logger"]
    assert ticket["containers"][0]["auto_flags"] == ["--link-remap"]
    assert "t0k" not in open(os.path.join(image, restore_protocol.TICKET)).read()  # only its digest is on disk
    assert oct(os.stat(os.path.join(image, restore_protocol.TICKET)).st_mode & 0o777) == "0o600"
    with pytest.raises(handler.Refused, match="is for pod default/p-b, not default/other"):
        handler.read_ticket(image, "default/other", "t0k")
    with pytest.raises(handler.Refused, match="token"):
        handler.read_ticket(image, "default/p-b", "guess")
    assert k8s_pod.read_restore_ticket(image)["pod"] == "default/p-b"


def test_the_target_pods_restore_request_is_what_the_handler_reads(handler):
    assert handler.RESTORE_ANNOTATION == "gpuckpt.fleet/restore"
    pod = pods.target_pod({"spec": {}, "namespace": "default", "uid": "u", "node": "node-a"}, "node-b", "p-b",
                          "/var/lib/gpuckpt/images/m1", "t0k")
    assert json.loads(pod["metadata"]["annotations"][handler.RESTORE_ANNOTATION]) == {
        "image": "/var/lib/gpuckpt/images/m1", "token": "t0k"}


def test_a_restore_the_handler_finishes_is_seen_by_the_node(handler, image, tmp_path):
    cdir = k8s_pod.container_dir(image, "trainer")
    assert k8s_pod.restore_claim(image, "trainer") is None
    assert handler.take_claim(cdir) == (True, None)
    assert k8s_pod.restore_claim(image, "trainer") == "restoring"
    handler.mark_restored(cdir, str(tmp_path), "default/p-b", "trainer")
    assert k8s_pod.restore_claim(image, "trainer") == "restored"
    assert handler.take_claim(cdir) == (False, "restored")  # the kubelet's restart of the job: plain runc


def test_a_node_restore_that_gives_up_stops_every_restore_of_the_pod(handler, image, tmp_path):
    """One container's restore is under way when the node gives up: it must not be marked restored (its copy is
    removed), and no create of either container may then restore or start the job from its entrypoint."""
    trainer = k8s_pod.container_dir(image, "trainer")
    assert handler.take_claim(trainer) == (True, None)
    for name in ("trainer", "logger"):
        k8s_pod.set_restore_claim(image, name, "failed")
    with pytest.raises(handler.Refused, match="gave up while container trainer was restored"):
        handler.mark_restored(trainer, str(tmp_path), "default/p-b", "trainer")
    assert k8s_pod.restore_claim(image, "trainer") == "failed"
    assert handler.take_claim(k8s_pod.container_dir(image, "logger")) == (False, "failed")
