"""migration/plan.py ``with_calls`` (the migration_plan filter): each later module call's arguments as the play's
options decide them, the restore job's limit, and the refusal of a new migration before anything is frozen."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import plan

NAMES = {"gpuckpt_mid": "m-1", "gpuckpt_src_root": "/img", "gpuckpt_dst_root": "/img-b",
         "gpuckpt_src_image": "/img/m-1", "gpuckpt_dst_image": "/img-b/m-1", "gpuckpt_src_journal": "/j",
         "gpuckpt_dst_journal": "/j-b", "gpuckpt_restore_progress": "/tmp/.gpuckpt-progress-x.json"}
NEW = {"settle": False, "new": True, "id_reuse": "", "pod_ref": None, "target_pod": None, "restore_token": None,
       "runtime": "process", "workload": "pid 42", "root_pid": 42, "error": "", "hold_stopped": True,
       "exit_reason": "", "one_pid_space": False, "restores_host_pids": True,
       "calls": {"source_facts": {"tree_of": 42}, "checkpoint": {"runtime": "process", "leave_stopped": True, "pid": 42}}}
POD = dict(NEW, runtime="k8s_pod", workload="pod ns/p", restores_host_pids=False,
           pod_ref={"namespace": "ns", "name": "p", "uid": "u1"}, target_pod="p-m-1", restore_token="t" * 40,
           calls={"source_facts": {"container": "ns/p", "runtime": "k8s_pod"},
                  "checkpoint": {"runtime": "k8s_pod", "leave_stopped": True, "pod": "ns/p", "pod_uid": "u1",
                                 "pod_containers": ["c"]}})


def calls(planned=None, source_vars=None, target_vars=None, **options):
    return plan.with_calls(planned or NEW, dict(NAMES, **options), "hosta", "hostb", source_vars=source_vars,
                           target_vars=target_vars)


def test_the_defaults_the_playbooks_document():
    out = calls()
    assert out["refusal"] == []
    assert out["checkpoint_args"] == {
        "runtime": "process", "leave_stopped": True, "pid": 42, "image_in_memory": False, "lock_timeout": 30.0,
        "quiesce_timeout": 30.0, "quiesce_mode": "release", "quiesce_lease": 600.0, "host_huge_pages": False,
        "runtime_timeout": 1800.0, "tcp_established": False, "migration_id": "m-1", "journal_dir": "/j",
        "push": {"to": "hostb", "dest": "/img-b/m-1", "journal_dir": "/j-b", "ssh_args": [], "streams": 0,
                 "io_timeout": 120}}
    assert out["restore_args"] == {
        "image_dir": "/img-b/m-1", "allow_unverified_signature": False, "runtime_timeout": 1800.0, "probe_timeout": 60.0,
        "host_huge_pages": False, "migration_id": "m-1", "journal_dir": "/j-b", "restore_wait": 600.0}
    assert out["restore_early_args"] == dict(out["restore_args"], wait_for_image=3600.0,
                                             progress_file="/tmp/.gpuckpt-progress-x.json")
    assert out["restore_now_args"] == dict(out["restore_args"], wait_for_image=120)
    assert out["restore_attach_args"] == {"image_dir": "/img-b/m-1", "progress_file": "/tmp/.gpuckpt-progress-x.json"}
    assert out["restore_early"] is True
    assert out["sync_args"] == {"dest": "/img-b/m-1", "ssh_args": [], "bwlimit": 0, "streams": 0, "io_timeout": 120,
                                "migration_id": "m-1", "journal_dir": "/j", "dest_journal_dir": "/j-b"}
    assert out["begin_args"] == {"action": "begin", "journal_dir": "/j-b", "image_dir": "/img-b/m-1",
                                 "image_in_memory": False}
    assert out["source_facts_args"] == {"tree_of": 42, "paths": ["/img"], "list_containers": [],
                                        "protect_dir": "/etc/gpuckpt/protect"}
    assert out["target_facts_args"] == {"paths": ["/img-b"], "list_containers": [], "protect_dir": "/etc/gpuckpt/protect",
                                        "journal_dir": "/j-b"}
    assert out["target_pod_args"] is None
    # the plan made on the source is kept as it was
    assert {k: out[k] for k in NEW} == NEW


@pytest.mark.parametrize("image_wait, runtime_timeout, limit", [
    (None, None, 3600 + 600 + 1800),
    (10, 20, 630),
    ("7.5", 0, 7 + 600 + 259200),  # a runtime without a limit counts as three days
])
def test_the_restore_job_outlives_its_waits(image_wait, runtime_timeout, limit):
    out = calls(gpuckpt_image_wait=image_wait, gpuckpt_runtime_timeout=runtime_timeout)
    assert out["restore_async_s"] == limit


@pytest.mark.parametrize("options, push", [
    ({}, True),
    ({"gpuckpt_transfer_during_dump": "false"}, False),
    ({"gpuckpt_transfer_bwlimit": 1000}, False),  # a limit is the sync's, after the dump
    ({"gpuckpt_transfer_bwlimit": "0", "gpuckpt_transfer_during_dump": "yes"}, True),
])
def test_the_push_during_the_dump(options, push):
    assert ("push" in calls(**options)["checkpoint_args"]) is push


def test_transfer_options_reach_the_push_and_the_sync():
    out = calls(gpuckpt_transfer_streams="4", gpuckpt_transfer_io_timeout=30, gpuckpt_transfer_python="/py",
                gpuckpt_transfer_ssh_args=["-p", "2222"])
    assert out["checkpoint_args"]["push"] == {"to": "hostb", "dest": "/img-b/m-1", "journal_dir": "/j-b",
                                              "ssh_args": ["-p", "2222"], "streams": 4, "io_timeout": 30,
                                              "python": "/py"}
    assert {k: out["sync_args"][k] for k in ("streams", "io_timeout", "python", "ssh_args")} == {
        "streams": 4, "io_timeout": 30, "python": "/py", "ssh_args": ["-p", "2222"]}


def test_the_target_calls_come_from_the_target_inventory_and_the_play():
    target_vars = {"gpuckpt_runc_bundle": "/b", "gpuckpt_probe_command": "true", "gpuckpt_protect_dir": "/p"}
    out = calls(target_vars=target_vars, gpuckpt_gpu_map={"GPU-a": "GPU-b"})
    assert out["restore_args"]["bundle"] == "/b" and out["restore_args"]["probe_command"] == "true"
    assert out["restore_args"]["gpu_map"] == {"GPU-a": "GPU-b"} and out["target_facts_args"]["protect_dir"] == "/p"
    # gpuckpt_bundle before the older gpuckpt_runc_bundle; the play's probe_command before the target's
    out = calls(target_vars=dict(target_vars, gpuckpt_bundle="/new"), probe_command="echo ok")
    assert out["restore_args"]["bundle"] == "/new" and out["restore_args"]["probe_command"] == "echo ok"


def test_quiesce_options_from_the_play_else_the_source_inventory():
    source_vars = {"gpuckpt_quiesce_signal": "USR1", "gpuckpt_quiesce_mode": "exit"}
    out = calls(source_vars=source_vars)
    assert out["checkpoint_args"]["quiesce_signal"] == "USR1" and out["checkpoint_args"]["quiesce_mode"] == "exit"
    out = calls(source_vars=source_vars, quiesce_signal="USR2", quiesce_command="/q")
    assert out["checkpoint_args"]["quiesce_signal"] == "USR2" and out["checkpoint_args"]["quiesce_command"] == "/q"


def test_the_preflight_options():
    held = calls(gpuckpt_allow_unknown="[gpu_memory, deadline,runtime]", gpuckpt_allow_driver_mismatch="yes")
    assert held["preflight_args"] == {
        "source_path": "/img", "target_path": "/img-b", "allow_driver_mismatch": True, "check_gpus": True,
        "gpu_map": None, "same_pid_space": False, "container": False, "allow_unknown": ["gpu_memory"],
        "image_in_memory": False, "target_image_in_memory": False, "migration_id": "m-1",
        "headline": "Migration m-1: hosta -> hostb, source held stopped until the target runs"}
    exits = calls(dict(NEW, hold_stopped=False, exit_reason="Podman cannot hold a container stopped",
                       restores_host_pids=False), gpuckpt_gpu_map={"a": "b"})
    assert exits["preflight_args"]["headline"] == ("Migration m-1: hosta -> hostb, Podman cannot hold a container "
                                                   "stopped: the source exits and its image is the way back")
    assert exits["preflight_args"]["container"] is True and exits["preflight_args"]["check_gpus"] is False


def test_image_in_memory():
    out = calls(gpuckpt_image_in_memory=True, gpuckpt_target_image_in_memory="true", gpuckpt_image_memory_bytes=2048)
    assert out["checkpoint_args"]["image_in_memory"] is True and out["checkpoint_args"]["image_memory_bytes"] == 2048
    # the target's tmpfs: the size given (else gpu_migration takes the preflight's estimate)
    assert out["begin_args"]["image_in_memory"] is True and out["begin_args"]["image_memory_bytes"] == 2048
    assert out["preflight_args"]["image_in_memory"] and out["preflight_args"]["target_image_in_memory"]


def test_a_pod_migration():
    out = calls(POD, gpuckpt_move_pod={"name": "p"}, gpuckpt_move_pod_node="node-b")
    assert out["restore_args"]["restore_pod"] == "ns/p-m-1" and out["restore_args"]["restore_token"] == "t" * 40
    assert out["target_pod_args"] == {"namespace": "ns", "name": "p-m-1", "from_pod": {"name": "p"},
                                      "target_node": "node-b", "image_dir": "/img-b/m-1", "restore_token": "t" * 40,
                                      "runtime_class": "gpuckpt-restore", "migration_id": "m-1"}
    assert out["checkpoint_args"]["pod"] == "ns/p" and out["checkpoint_args"]["pod_containers"] == ["c"]
    assert out["source_facts_args"]["container"] == "ns/p"
    assert out["summary_args"] == {"migration_id": "m-1", "workload": "pod ns/p", "source": "hosta", "target": "hostb",
                                   "pod": POD["pod_ref"], "target_pod": "p-m-1"}


@pytest.mark.parametrize("planned, options, source_vars, target_vars, says", [
    (dict(NEW, root_pid=None), {}, {}, {}, "migrate.yml needs one of -e pid=<root pid of the workload on hosta>"),
    (dict(NEW, root_pid=None, error="pid 42 was not found on the source: gone"), {}, {}, {},
     "pid 42 was not found on the source: gone; nothing was frozen"),
    (NEW, {"gpuckpt_target_image_in_memory": True, "gpuckpt_keep_target_image": "yes"}, {}, {},
     "gpuckpt_keep_target_image would hold the image's tmpfs, and its RAM, on hostb"),
    (NEW, {}, {"gpuckpt_sign_key": "k"}, {}, "gpuckpt_sign_key differs between hosta and hostb"),
    (NEW, {}, {"gpuckpt_sign_key": "k"}, {"gpuckpt_sign_key": "other"}, "gpuckpt_sign_key differs"),
])
def test_a_new_migration_is_refused_before_anything_is_frozen(planned, options, source_vars, target_vars, says):
    refusal = calls(planned, source_vars=source_vars, target_vars=target_vars, **options)["refusal"]
    assert len(refusal) == 1 and refusal[0].startswith(says), refusal


def test_options_out_of_range_are_refused_first():
    refusal = calls(dict(NEW, root_pid=None), gpuckpt_transfer_streams=-1, gpuckpt_lock_timeout="soon")["refusal"]
    assert refusal[0] == "Nothing was frozen: fix these options first" and len(refusal) == 3, refusal


def test_the_same_key_on_both_hosts_and_a_settlement_are_not_refused():
    assert calls(source_vars={"gpuckpt_sign_key": "k"}, target_vars={"gpuckpt_sign_key": "k"})["refusal"] == []
    settle = {"settle": True, "new": False, "id_reuse": "", "pod_ref": None, "target_pod": None, "restore_token": None,
              "calls": {}}
    out = calls(settle, gpuckpt_lock_timeout=-1)
    assert out["refusal"] == [] and out["checkpoint_args"]["migration_id"] == "m-1"
