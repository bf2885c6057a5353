"""fleet/protect_carry.py and core/replica_owner.handover: a protected job that a migration moved takes its protection
along (issue 43, 7): which workload is which job, what the target gets, the replica's record handed over once."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import replica, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_carry


def write_job(protect_dir, name, **over):
    os.makedirs(protect_dir, exist_ok=True)
    cfg = {"job": name, "node": "node-a", "interval_s": 300, "keep": 2, "epoch": 1, "image_root": "/srv/images",
           "replicas": [{"name": "rep1", "host": "10.0.0.2", "root": "/r"},
                        {"name": "node-b", "host": "10.0.0.3", "root": "/r"}],
           "checkpoint": {"lock_timeout": 7, "runc_root": "/run/runc-a", "quiesce_signal": ["SIGUSR1", 10]},
           "progress_file": "/srv/train/progress.json", "progress_key": "step"}
    cfg.update(over)
    path = os.path.join(protect_dir, name + ".json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    os.chmod(path, 0o600)
    return cfg


def journal(journal_dir, mid, role, phase_steps, **data):
    j = Journal(journal_dir, mid, role)
    with j.hold(wait=1):
        for phase in phase_steps:
            j.transition(phase, **data)
            data = {}
    return j


@pytest.fixture
def dirs(tmp_path):
    pid_file = tmp_path / "train.pid"
    pid_file.write_text("4242\n")
    return {"protect": str(tmp_path / "protect"), "journal": str(tmp_path / "journal"), "pid_file": str(pid_file),
            "tmp": tmp_path}


def test_the_migrated_pid_is_found_as_its_protected_job_and_its_spec_leaves_the_hosts_own_options(dirs):
    write_job(dirs["protect"], "other", pid_file=str(dirs["tmp"] / "none.pid"))
    write_job(dirs["protect"], "train", pid_file=dirs["pid_file"])
    journal(dirs["journal"], "m-1", "source", ["planned"], pids=[4242, 4243], container=None)
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-1", "node-b")
    assert plan["carry"] and plan["job"] == "train", plan
    assert plan["replicas"] == ["rep1", "node-b"] and plan["target_replicas"] == ["rep1"]
    spec = plan["spec"]
    assert spec["pid_file"] == dirs["pid_file"] and spec["interval"] == 300 and spec["keep"] == 2
    assert spec["checkpoint"] == {"lock_timeout": 7, "quiesce_signal": ["SIGUSR1", 10]}  # no runc_root of node-a
    assert spec["progress_key"] == "step"


def test_a_workload_that_is_no_protected_job_or_a_pod_or_whose_only_replica_is_the_target_is_not_carried(dirs):
    journal(dirs["journal"], "m-2", "source", ["planned"], pids=[999], container=None)
    write_job(dirs["protect"], "train", pid_file=dirs["pid_file"])
    assert protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-2", "node-b")["job"] is None
    journal(dirs["journal"], "m-3", "source", ["planned"], pids=[4242], container=None)
    lonely = write_job(dirs["protect"], "train", pid_file=dirs["pid_file"],
                       replicas=[{"name": "node-b", "host": "10.0.0.3", "root": "/r"}])
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-3", "node-b")
    assert plan["job"] == lonely["job"] and not plan["carry"] and "only replica" in plan["why"], plan
    write_job(dirs["protect"], "svc", pid_file=None, container="svc-1", runtime="runc")
    journal(dirs["journal"], "m-4", "source", ["planned"], pids=[77], container="svc-1")
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-4", "node-b")
    assert plan["carry"] and plan["spec"]["container"] == "svc-1" and plan["spec"]["runtime"] == "runc", plan


def test_the_pid_file_is_written_from_the_restored_root_pid_and_a_symlink_is_replaced_not_followed(dirs):
    journal(dirs["journal"], "m-5", "target", ["receiving", "received", "restoring", "restored"], pids=[5151, 5152])
    victim = dirs["tmp"] / "victim"
    victim.write_text("keep")
    link = dirs["tmp"] / "run" / "train.pid"
    link.parent.mkdir()
    os.symlink(str(victim), str(link))
    assert protect_carry.write_pid_file(str(link), dirs["journal"], "m-5") == (True, 5151)
    assert victim.read_text() == "keep" and not os.path.islink(str(link)) and link.read_text() == "5151\n"
    assert protect_carry.write_pid_file(str(link), dirs["journal"], "m-5") == (False, 5151)  # again: no change
    journal(dirs["journal"], "m-6", "target", ["receiving"])
    with pytest.raises(InvalidTarget, match="restored nothing"):
        protect_carry.write_pid_file(str(link), dirs["journal"], "m-6")


def test_a_handover_names_the_target_at_the_next_epoch_once_and_refuses_a_third_owner(tmp_path):
    root = str(tmp_path / "replicas")
    replica.check_push(root, "train", 3, "node-a")  # the first push records node-a at epoch 3
    res = replica_owner.handover(root, "train", "node-a", "node-b", "migration m-1", write=False)
    assert res["changed"] and res["record"]["owner"] == "node-b"
    assert replica.check(root, "train", 3, "node-a")["fenced"] is False  # check mode wrote nothing
    res = replica_owner.handover(root, "train", "node-a", "node-b", "migration m-1")
    assert res["record"]["epoch"] == 4 and res["record"]["history"][-1]["event"] == "moved"
    assert replica_owner.handover(root, "train", "node-a", "node-b")["changed"] is False  # a re-run changes nothing
    assert replica.check(root, "train", 3, "node-a")["fenced"] is True  # the old node's copy is fenced
    assert replica.check(root, "train", 4, "node-b")["fenced"] is False
    with pytest.raises(replica.FailoverRefused, match="belongs to node-b"):
        replica_owner.handover(root, "train", "node-c", "node-d")
    assert replica_owner.handover(root, "never-pushed", "node-a", "node-b") == {"record": None, "changed": False}
