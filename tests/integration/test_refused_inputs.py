"""Inputs that must be refused before anything runs (issue 43 item 11): checkpoint_now.yml's `within` that is not a
positive, finite number of seconds (`within=x` became 0.0 through `| float`, `within=-5` ran a checkpoint), and the
protect role's job named "nl\\n" (it wrote `nl\\n.json`). Against localhost with a local connection: each play stops
at its assert, before a module of the collection runs."""
from __future__ import annotations

import os

import pytest

CHECKPOINT_NOW = "gpuckpt.fleet.checkpoint_now"
PROTECT = "gpuckpt.fleet.protect"


def _now(playbook, tmp_path, within):
    protect_dir = tmp_path / "protect"
    protect_dir.mkdir(exist_ok=True)
    # As an operator types it: `-e within=...` gives a string.
    return playbook(CHECKPOINT_NOW, {"node": "localhost", "job": "train-1", "gpuckpt_protect_dir": str(protect_dir)},
                    args=("-e", "within=%s" % within))


# (one of each kind: the unit tests of gpu_protect's and the CLI's checks take the rest; each run is a playbook)
@pytest.mark.parametrize("within", ["-5", "x", "inf", "''"])
def test_checkpoint_now_refuses_a_within_that_is_no_positive_finite_number(tmp_path, playbook, within):
    run = _now(playbook, tmp_path, within)
    assert run.rc != 0, run.stdout
    res = run.task("Require within")
    assert res["_status"] == "failed", run.stdout
    assert "within must be a positive, finite number of seconds" in res["msg"], res
    assert "nothing was checkpointed" in res["msg"]
    assert not [r for r in run.results if "Checkpoint the job now" in r["_task"]], "the module must not run"


@pytest.mark.parametrize("within", ["0.5"])
def test_checkpoint_now_takes_a_positive_within(tmp_path, playbook, within):
    """The check lets a number through: the module runs (and fails here, since no job is protected in this dir)."""
    run = _now(playbook, tmp_path, within)
    assert run.task("Require within")["_status"] == "ok", run.stdout
    res = run.task("Checkpoint the job now")
    assert res["_status"] == "failed" and "not protected on this node" in res["msg"], res


@pytest.mark.parametrize("within", [0, float("nan")])
def test_the_module_refuses_a_within_that_is_no_positive_finite_number(tmp_path, playbook, within):
    """gpu_protect itself, for a task that passes the number straight (json: NaN and Infinity)."""
    play = tmp_path / "play.yml"
    play.write_text("""
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Checkpoint now
      gpuckpt.fleet.gpu_protect:
        state: checkpoint_now
        job: train-1
        within: "{{ within_given }}"
        protect_dir: %s
""" % (tmp_path / "protect"))
    run = playbook(str(play), {"within_given": within})
    res = run.task("Checkpoint now")
    assert res["_status"] == "failed", run.stdout
    assert "within must be a positive number of seconds" in res["msg"] and res.get("stage") == "preflight", res
    assert not os.path.exists(tmp_path / "protect")


@pytest.mark.parametrize("state", ["present", "absent"])
def test_the_protect_role_refuses_a_job_name_with_a_trailing_newline(tmp_path, playbook, state):
    protect_dir = tmp_path / "protect"
    job = {"name": "nl\n", "pid_file": str(tmp_path / "pid")}
    if state == "absent":
        job["state"] = "absent"
    run = playbook(PROTECT, {"node": "localhost", "gpuckpt_protected_jobs": [job], "gpuckpt_protect_replicas": ["hostb"],
                             "gpuckpt_protect_dir": str(protect_dir),
                             "gpuckpt_protect_replica_root": str(tmp_path / "replicas"),
                             "gpuckpt_protect_image_root": str(tmp_path / "images"),
                             "gpuckpt_protect_lib_dir": str(tmp_path / "lib"),
                             "gpuckpt_protect_bin": str(tmp_path / "bin"), "gpuckpt_protect_systemd": False},
                   inventory="localhost,hostb,", check=True, args=("-e", "ansible_connection=local"))
    assert run.rc != 0, run.stdout
    res = run.task("Check each job to remove" if state == "absent" else "Check each job")
    assert res["_status"] == "failed", run.stdout
    assert "must have a name of 1-64" in str(res.get("msg")) + str(res.get("results")), res
    assert not os.path.exists(protect_dir) and not os.path.exists(tmp_path / "replicas")
