"""The failover's filters as failover.yml and images.yml call them: thin wrappers over fleet/restorability.py,
given registered results (gpu_replica's list, cuda_process_facts) as Ansible hands them over."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.filter.failover_plan import FilterModule as PlanFilters, failover_plan
from ansible_collections.gpuckpt.fleet.plugins.filter.image_restorability import (
    FilterModule as ImageFilters, image_restorability)

from test_restorability import GIB, ROOT, host, image


def registered_facts(facts):
    return {"changed": False, "ansible_facts": {"gpuckpt": facts}}


def registered_list(images, owner="node1", epoch=1):
    return {"changed": False, "msg": "%d image(s)" % len(images), "images": images,
            "record": {"job": "train", "epoch": epoch, "owner": owner, "history": []}}


IMAGES = [image("img-1", at="2026-11-25T09:00:00+00:00"), image("img-2", at="2026-11-25T09:15:00+00:00")]


def test_the_filters_are_registered_by_their_names():
    assert set(PlanFilters().filters()) == {"failover_plan"}
    assert set(ImageFilters().filters()) == {"image_restorability"}


def test_failover_plan_from_registered_results():
    plan = failover_plan({"rep1": registered_list(IMAGES)}, {"hostb": registered_facts(host("hostb"))}, job="train",
                         lost_node="node1", target="hostb", target_paths={"hostb": ROOT})
    assert plan["ok"] and plan["target"] == "hostb" and plan["replica"] == "rep1"
    assert plan["image"]["id"] == "img-2" and plan["candidates"] == ["img-2", "img-1"]


def test_failover_plan_refuses_the_lost_node_as_the_named_target():
    plan = failover_plan({"rep1": registered_list(IMAGES)}, {"node1": registered_facts(host("node1"))}, job="train",
                         lost_node="node1", target="node1")
    assert not plan["ok"] and plan["refused"] == "the target node1 is the lost node itself"


def test_failover_plan_a_named_target_that_was_not_asked_is_no_target():
    plan = failover_plan({"rep1": registered_list(IMAGES)}, {}, job="train", lost_node="node1", target="hostb")
    assert not plan["ok"] and plan["refused"] == "no host to fail over to could be asked: hostb: no facts: not asked"


def test_failover_plan_an_unreachable_replica_is_named_and_the_others_serve():
    plan = failover_plan({"rep1": {"unreachable": True, "msg": "ssh: no route", "changed": False},
                          "rep2": registered_list([dict(i, replica="rep2") for i in IMAGES])},
                         {"hostb": registered_facts(host("hostb"))}, job="train", lost_node="node1",
                         target_paths={"hostb": ROOT})
    assert plan["ok"] and plan["replica"] == "rep2"
    assert plan["unread_replicas"] == {"rep1": "unreachable: ssh: no route"}
    assert "  REPLICA rep1 not read: unreachable: ssh: no route" in plan["lines"]


def test_failover_plan_with_unknown_gpu_memory_refuses_unless_allowed_by_name():
    facts = {"hostb": registered_facts(host("hostb", free_mib=None))}
    refused = failover_plan({"rep1": registered_list(IMAGES)}, facts, job="train", lost_node="node1",
                            target_paths={"hostb": ROOT})
    assert not refused["ok"] and "free GPU memory on target" in refused["skipped"][0]["reason"]
    allowed = failover_plan({"rep1": registered_list(IMAGES)}, facts, job="train", lost_node="node1",
                            target_paths={"hostb": ROOT}, allow_unknown="gpu_memory")
    assert allowed["ok"] and allowed["image"]["id"] == "img-2"


def test_failover_plan_refuses_a_second_failover():
    plan = failover_plan({"rep1": registered_list(IMAGES, owner="hostb", epoch=2)},
                         {"hostc": registered_facts(host("hostc"))}, job="train", lost_node="node1")
    assert not plan["ok"] and "already failed over" in plan["refused"]


def test_failover_plan_bad_input_and_bad_names_are_the_filters_errors():
    with pytest.raises(AnsibleFilterError, match="names no check"):
        failover_plan({"rep1": registered_list(IMAGES)}, {}, job="train", lost_node="node1", allow_unknown=["gpu"])
    with pytest.raises(AnsibleFilterError, match="by name"):
        failover_plan([], {}, job="train", lost_node="node1")


def test_image_restorability_lists_and_judges_each_image_for_one_host():
    newest = image("img-3", at="2026-11-25T09:30:00+00:00", driver="570.86")
    out = image_restorability({"rep1": registered_list(IMAGES + [newest])},
                              host_facts=registered_facts(host("hostb")), host="hostb", job="train", target_path=ROOT)
    assert [(i["id"], i["restorable"]) for i in out["images"]] == [("img-3", False), ("img-2", True), ("img-1", True)]
    assert out["images"][0]["reasons"] == ["driver version: 570.86 in the image, 580.65 on the target"]
    assert out["lines"][0] == "Images of job train (owner node1, epoch 1): 3 on 1 replica(s)"


def test_image_restorability_accepts_the_mismatch_by_name_and_a_list_of_images():
    out = image_restorability([image("img-3", driver="570.86")], host_facts=host("hostb"), host="hostb",
                              target_path=ROOT, allow_driver_mismatch=True)
    assert out["images"][0]["restorable"] is True


def test_image_restorability_without_a_host_only_lists_and_says_why_a_host_was_not_asked():
    listed = image_restorability({"rep1": registered_list(IMAGES)})
    assert [i["id"] for i in listed["images"]] == ["img-2", "img-1"] and "restorable" not in listed["images"][0]
    unreachable = image_restorability({"rep1": registered_list(IMAGES)}, host_facts={"unreachable": True, "msg": "x"},
                                      host="hostb")
    assert unreachable["lines"][-1] == "  hostb could not be asked: unreachable: x"
    assert all("restorable" not in i for i in unreachable["images"])
    with pytest.raises(AnsibleFilterError):
        image_restorability("rep1")


def test_sizes_are_shown_for_people():
    assert "3.0 GiB" in image_restorability([image(size=3 * GIB)])["lines"][1]
    assert "  12.5 MiB  " in image_restorability([image(size=int(12.5 * 2**20))])["lines"][1]
