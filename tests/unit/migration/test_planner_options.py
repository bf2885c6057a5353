"""migration/planner.py: option_errors (the numbers a playbook takes, checked before anything is frozen); and
migration/id_reuse.py: id_reuse (a migration id that has a journal, named again for another workload)."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import id_reuse, planner

ABOVE_0 = "must be a number above 0"
NOT_NEGATIVE = "must be a number of 0 or more (0: no limit)"
WHOLE = "must be a whole number of 1 or more"


@pytest.mark.parametrize("values,errors", [
    ({}, []),
    ({"gpuckpt_runtime_timeout": -1}, ["gpuckpt_runtime_timeout=-1 " + NOT_NEGATIVE]),
    ({"gpuckpt_runtime_timeout": 0}, []),  # 0: no limit
    ({"gpuckpt_image_wait": 0}, ["gpuckpt_image_wait=0 " + ABOVE_0]),
    ({"gpuckpt_image_wait": "0.5"}, []),
    ({"gpuckpt_lock_timeout": -0.1}, ["gpuckpt_lock_timeout=-0.1 " + ABOVE_0]),
    ({"drain_parallel": 0}, ["drain_parallel=0 " + WHOLE]),
    ({"drain_parallel": 1.5}, ["drain_parallel=1.5 " + WHOLE]),
    ({"drain_parallel": "2"}, []),
    ({"drain_parallel": 2.0}, []),
    ({"deadline": "abc"}, ["deadline='abc' " + ABOVE_0]),
    ({"deadline": ""}, ["deadline='' " + ABOVE_0]),
    ({"deadline": [600]}, ["deadline=[600] " + ABOVE_0]),
    ({"deadline": float("nan")}, ["deadline=nan " + ABOVE_0]),
    ({"deadline": "inf"}, ["deadline='inf' " + ABOVE_0]),
    ({"gpuckpt_transfer_streams": float("inf")}, ["gpuckpt_transfer_streams=inf " + NOT_NEGATIVE]),
    ({"drain_parallel": float("inf")}, ["drain_parallel=inf " + WHOLE]),
    ({"drain_parallel": "-inf"}, ["drain_parallel='-inf' " + WHOLE]),
    ({"pid": 0}, ["pid=0 " + ABOVE_0]),
    ({"pid": "4242"}, []),
    ({"gpuckpt_image_root": "/x", "gpuckpt_transfer_ssh_args": -1, "node": -5}, []),  # no rule: not looked at
    ({"gpuckpt_image_wait": None, "deadline": None}, []),  # not given
    ({"gpuckpt_settle_wait": 0, "drain_parallel": 0, "deadline": -1},  # each named, in the order of their names
     ["deadline=-1 " + ABOVE_0, "drain_parallel=0 " + WHOLE, "gpuckpt_settle_wait=0 " + ABOVE_0]),
])
def test_option_errors(values, errors):
    assert planner.option_errors(values) == errors


def test_every_rule_has_its_text():
    assert set(planner.OPTION_RULES.values()) <= {planner.POSITIVE, planner.NOT_NEGATIVE, planner.AT_LEAST_ONE}
    for name, rule in planner.OPTION_RULES.items():
        assert planner.option_errors({name: -1}), name  # -1 breaks every rule


# -- an id used before -----------------------------------------------------------------------------------

PID_JOURNAL = {"exists": True, "phase": "committed", "pids": [4242, 4243],
               "identities": {"4242": {"pid": 4242, "starttime": 777, "boot_id": "b"}}}
CONTAINER_JOURNAL = {"exists": True, "phase": "held", "container": "train-7", "runtime": "runc", "pids": [900]}
POD_JOURNAL = {"exists": True, "phase": "restoring", "pod": {"namespace": "ml", "name": "train-0"}, "pids": [900]}


@pytest.mark.parametrize("case,journal,named", [
    ("same pid, same process", PID_JOURNAL, dict(pid=4242, pid_now={"starttime": 777})),
    ("same pid given as text", PID_JOURNAL, dict(pid="4242", pid_now={"starttime": 777})),
    ("same pid, no process holds it now", PID_JOURNAL, dict(pid=4242, pid_now=None)),
    ("same pid, the journal kept no start time", dict(PID_JOURNAL, identities={}), dict(pid=4242, pid_now={"starttime": 5})),
    ("same container", CONTAINER_JOURNAL, dict(container="train-7")),
    ("same pod by namespace/name", POD_JOURNAL, dict(pod="ml/train-0")),
    ("same pod by name", POD_JOURNAL, dict(pod="train-0")),
    ("a pod recorded as text", dict(POD_JOURNAL, pod="ml/train-0"), dict(pod="ml/train-0")),
    ("no journal", None, dict(pid=1)),
    ("a journal that does not exist", {"exists": False, "pids": [1]}, dict(pid=2)),
    ("nothing named", PID_JOURNAL, dict()),
])
def test_the_same_workload_may_use_its_id_again(case, journal, named):
    assert id_reuse.id_reuse("m-42", journal, **named) is None, case


@pytest.mark.parametrize("case,journal,named,recorded,asked", [
    ("other pid", PID_JOURNAL, dict(pid=5000), "pid 4242", "pid 5000"),
    ("same pid, another process", PID_JOURNAL, dict(pid=4242, pid_now={"starttime": 999}), "pid 4242", "pid 4242"),
    ("other container", CONTAINER_JOURNAL, dict(container="train-8"), "container train-7 (runc)", "container train-8"),
    ("a container for a pid's id", PID_JOURNAL, dict(container="train-7"), "pid 4242", "container train-7"),
    ("a pid for a container's id", CONTAINER_JOURNAL, dict(pid=4242), "container train-7 (runc)", "pid 4242"),
    ("other pod", POD_JOURNAL, dict(pod="ml/train-1"), "pod ml/train-0", "pod ml/train-1"),
    ("same name, other namespace", POD_JOURNAL, dict(pod="dev/train-0"), "pod ml/train-0", "pod dev/train-0"),
    ("a pod for a pid's id", PID_JOURNAL, dict(pod="ml/train-0"), "pid 4242", "pod ml/train-0"),
    ("a pid for a journal without pids", {"exists": True, "phase": "begun"}, dict(pid=1), "an unknown workload", "pid 1"),
])
def test_another_workload_is_refused_naming_both(case, journal, named, recorded, asked):
    why = id_reuse.id_reuse("m-42", journal, **named)
    assert why is not None, case
    assert why.startswith("migration id m-42 was used before for %s (phase %s); this run names %s"
                          % (recorded, journal.get("phase"), asked)), why
    assert "choose another migration_id" in why


def test_a_pid_another_process_holds_now_says_so():
    why = id_reuse.id_reuse("m-42", PID_JOURNAL, pid=4242, pid_now={"starttime": 999})
    assert "another process holds it now" in why and "999" in why and "777" in why


def test_the_same_workload_under_a_new_start_time_is_still_the_same():
    """One machine seen as two hosts: a rollback restores the source from its image (the same pid, a new start time),
    a commit leaves its copy under the same pid; a re-run with the id and the pid finishes or reports it."""
    rolled_back = dict(PID_JOURNAL, phase="resumed", resumed_identities={"4242": {"pid": 4242, "starttime": 777}})
    assert id_reuse.id_reuse("m-42", rolled_back, pid=4242, pid_now={"starttime": 777}) is None
    target = {"exists": True, "phase": "committed", "identities": {"4242": {"pid": 4242, "starttime": 888}}}
    assert id_reuse.id_reuse("m-42", PID_JOURNAL, pid=4242, pid_now={"starttime": 888}, target_journal=target) is None
    assert id_reuse.id_reuse("m-42", PID_JOURNAL, pid=4242, pid_now={"starttime": 999}, target_journal=target)
