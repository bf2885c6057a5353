"""fleet/protect_carry.py and replica/replica_owner.handover: a protected job that a migration moved takes its protection
along (issue 43, 7): which workload is which job, what the target gets, the replica's record handed over once."""
from __future__ import annotations

import json
import os
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_carry, protect_fence
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_history as hist


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


def ident(pid, ago=60.0, starttime=None):
    """A process identity of this boot, as a migration's journal records it: started ``ago`` seconds ago."""
    if starttime is None:
        starttime = int((time.time() - ago - protect_fence._boot_time()) * os.sysconf("SC_CLK_TCK"))
    return {"pid": pid, "starttime": starttime, "boot_id": procfs.boot_id()}


def source(journal_dir, mid, pids, container=None, **idents):
    """The source journal of migration ``mid``: its pids, their identities (started a minute ago, unless given)."""
    ids = {str(p): idents.get("i%d" % p) or ident(p) for p in pids}
    return journal(journal_dir, mid, "source", ["planned"], pids=pids, identities=ids, container=container)


@pytest.fixture
def dirs(tmp_path):
    pid_file = tmp_path / "train.pid"
    pid_file.write_text("4242\n")
    return {"protect": str(tmp_path / "protect"), "journal": str(tmp_path / "journal"), "pid_file": str(pid_file),
            "tmp": tmp_path}


def test_the_migrated_pid_is_found_as_its_protected_job_and_its_spec_leaves_the_hosts_own_options(dirs):
    write_job(dirs["protect"], "other", pid_file=str(dirs["tmp"] / "none.pid"))
    write_job(dirs["protect"], "train", pid_file=dirs["pid_file"])
    source(dirs["journal"], "m-1", [4242, 4243])
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-1", "node-b")
    assert plan["carry"] and plan["job"] == "train", plan
    assert plan["replicas"] == ["rep1", "node-b"] and plan["target_replicas"] == ["rep1"]
    spec = plan["spec"]
    assert spec["pid_file"] == dirs["pid_file"] and spec["interval"] == 300 and spec["keep"] == 2
    assert spec["checkpoint"] == {"lock_timeout": 7, "quiesce_signal": ["SIGUSR1", 10]}  # no runc_root of node-a
    assert spec["progress_key"] == "step"


def test_a_workload_that_is_no_protected_job_or_a_pod_or_whose_only_replica_is_the_target_is_not_carried(dirs):
    source(dirs["journal"], "m-2", [999])
    write_job(dirs["protect"], "train", pid_file=dirs["pid_file"])
    assert protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-2", "node-b")["job"] is None
    source(dirs["journal"], "m-3", [4242])
    lonely = write_job(dirs["protect"], "train", pid_file=dirs["pid_file"],
                       replicas=[{"name": "node-b", "host": "10.0.0.3", "root": "/r"}])
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-3", "node-b")
    assert plan["job"] == lonely["job"] and not plan["carry"] and "only replica" in plan["why"], plan
    write_job(dirs["protect"], "svc", pid_file=None, container="svc-1", runtime="runc")
    source(dirs["journal"], "m-4", [77], container="svc-1")
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


def test_a_pid_is_never_matched_bare_a_reused_pid_or_a_fenced_job_is_passed_over_and_said(dirs):
    """pids are reused (the loopback tests start every workload at the same pid): a job that ended or was failed
    over leaves its pid file naming the pid of the workload migrated later. Such a job is not carried (its record
    would be handed over, or its config removed, in place of the moved job's): the moved process must be the job's
    by the runner's rule (identity.json's start time, else a pid file written after it started), and a job fenced
    here is not it. Each passed over is said."""
    tmp = dirs["tmp"]
    for name in ("ended", "fenced", "moved", "restarted"):
        (tmp / (name + ".pid")).write_text("4242\n")
    for name in ("ended", "fenced", "moved", "restarted"):
        write_job(dirs["protect"], name, pid_file=str(tmp / (name + ".pid")))
    moved = ident(4242, ago=0.0)  # the workload migrated now started just now, after every pid file was written...
    os.utime(str(tmp / "ended.pid"), (time.time() - 600, time.time() - 600))  # ...but its job's, ten minutes before
    for name in ("ended", "fenced", "restarted"):  # (their pid files written before the moved process started)
        os.utime(str(tmp / (name + ".pid")), (time.time() - 600, time.time() - 600))
    hist.write_state(_state(dirs, "restarted"), hist.IDENTITY, dict(moved, starttime=moved["starttime"] - 1000))
    hist.write_state(_state(dirs, "moved"), hist.IDENTITY, moved)  # its last checkpoint saw this very process
    hist.write_state(_state(dirs, "fenced"), hist.IDENTITY, moved)
    hist.write_state(_state(dirs, "fenced"), hist.FENCED, {"epoch": 1, "at": "then", "reason": "failed over"})
    source(dirs["journal"], "m-7", [4242], i4242=moved)
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-7", "node-b")
    assert plan["carry"] and plan["job"] == "moved", plan
    said = " ".join(plan["passed_over"])
    assert "job ended" in said and "job restarted" in said and "job fenced: fenced" in said, plan

    os.unlink(os.path.join(dirs["protect"], "moved.json"))  # the moved one unprotected: nothing carried, and said
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-7", "node-b")
    assert plan["job"] is None and not plan["carry"] and "passed over" in plan["why"], plan

    source(dirs["journal"], "m-8", [4242], i4242=ident(4242, ago=0.0))  # no identity.json: the pid file's time
    write_job(dirs["protect"], "fresh", pid_file=str(tmp / "fresh.pid"))
    (tmp / "fresh.pid").write_text("4242\n")  # written now, after the process started
    assert protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-8", "node-b")["job"] == "fresh"
    journal(dirs["journal"], "m-9", "source", ["planned"], pids=[4242], container=None)  # no identity recorded
    plan = protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-9", "node-b")
    assert plan["job"] is None and "no identity" in plan["why"], plan

    write_job(dirs["protect"], "twin", pid_file=str(tmp / "fresh.pid"))  # two jobs of one pid file: refused
    with pytest.raises(InvalidTarget, match="claimed by jobs fresh, twin"):
        protect_carry.carry_plan(dirs["protect"], dirs["journal"], "m-8", "node-b")


def _state(dirs, name):
    folder = hist.state_dir(dirs["protect"], name)
    os.makedirs(folder, exist_ok=True)
    return folder


def test_a_handover_refuses_a_record_the_target_holds_by_a_failover_never_a_silent_no_change(tmp_path):
    """A record that names the target because the job was failed over there is not this move's to leave as it is:
    the workload moved from the old node was a stale copy or another job's (the pid of a job that ended). Only a
    record a move from that node handed over is a re-run's no-change, also after a re-protect there."""
    root = str(tmp_path / "replicas")
    replica.check_push(root, "infer", 1, "node-a")
    replica_owner.failover(root, "infer", "node-a", "node-b", "img-1", "node-a lost")
    with pytest.raises(replica.FailoverRefused, match="since its failover .from node-a. at epoch 2"):
        replica_owner.handover(root, "infer", "node-a", "node-b", "migration m-1")
    assert replica.check(root, "infer", 2, "node-b")["fenced"] is False  # nothing written

    replica.check_push(root, "train", 1, "node-a")
    replica_owner.handover(root, "train", "node-a", "node-b", "migration m-2")
    replica_owner.reprotect(root, "train", 5, "node-b")  # the target protected it again at a higher epoch
    res = replica_owner.handover(root, "train", "node-a", "node-b", "migration m-2")  # recover.yml's re-run
    assert res["changed"] is False and res["record"]["epoch"] == 5
    with pytest.raises(replica.FailoverRefused, match="not since a move from node-c"):
        replica_owner.handover(root, "train", "node-c", "node-b")

    replica.check_push(root, "born", 1, "node-b")  # first protected on the target itself
    with pytest.raises(replica.FailoverRefused, match="since its adopted"):
        replica_owner.handover(root, "born", "node-a", "node-b")
