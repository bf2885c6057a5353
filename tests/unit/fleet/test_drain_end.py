"""The end of a drain as the hosts show it (fleet/report.end_state, the drain_end filter), and whether a target's copy
may have run and is gone (the lost_copy filter): issue 43, items 2 and 3."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.filter.drain_end import drain_end
from ansible_collections.gpuckpt.fleet.plugins.filter.lost_copy import lost_copy
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import report

GIB = 2**30
BOOT = "b00t"


def proc(pid, comm="python3", start=100):
    return {"key": "process:%d" % pid, "kind": "process", "runtime": "process", "pid": pid, "root_pid": pid,
            "comm": comm, "tree": {"pids": [pid], "rss_bytes": GIB, "gpu_bytes": GIB},
            "identities": {str(pid): {"pid": pid, "starttime": start, "boot_id": BOOT}}}


A, B, LATE = proc(4242), proc(5120), proc(7000)
PLAN = {"moves": [{"workload": A, "target": "hostb", "migration_id": "d-4242", "image_estimate_bytes": GIB,
                   "estimate": {"duration_s": 30}},
                  {"workload": B, "target": "hostc", "migration_id": "d-5120", "image_estimate_bytes": GIB}],
        "stays": [], "left_out": []}


def journal(phase, running=(), stopped=(), identities=None, **kw):
    j = {"exists": True, "phase": phase, "running_pids": list(running), "stopped_pids": list(stopped),
         "alive_pids": sorted(list(running) + list(stopped)), "identities": identities or {}}
    j.update(kw)
    return j


def moved(pid, start=900):
    return {"source": journal("committed"),
            "target": journal("committed", running=[pid],
                              identities={str(pid): {"pid": pid, "starttime": start, "boot_id": BOOT}}),
            "target_error": ""}


def test_every_move_moved_and_the_node_found_empty_is_empty():
    out = drain_end(PLAN, {"d-4242": {"status": "moved", "downtime_s": 1.5}, "d-5120": {"status": "moved"}},
                    {"d-4242": moved(4242), "d-5120": moved(5120)}, [], node="hosta")
    assert out["empty"] is True and out["still"] == [] and out["gone"] == []
    assert out["lines"][1].startswith("  MOVED   pid 4242 (python3) -> hostb: downtime 2 s"), out["lines"]
    assert "runs there (pids 4242)" in out["lines"][1]


def test_a_job_started_after_the_plan_keeps_the_node_from_being_empty():
    out = drain_end(PLAN, {}, {"d-4242": moved(4242), "d-5120": moved(5120)}, [LATE], node="hosta")
    assert out["empty"] is False and out["still"] == ["pid 7000 (python3)"]
    assert "  STILL   pid 7000 (python3) on hosta: not in this drain's plan (it started after the plan)" in out["lines"]


def test_what_a_move_said_is_not_taken_for_where_its_job_runs():
    """A move that said "moved" while its copy no longer runs on its target, and the node does not run it: GONE."""
    seen = {"d-4242": {"source": journal("committed"), "target": journal("committed"), "target_error": ""},
            "d-5120": moved(5120)}
    out = drain_end(PLAN, {"d-4242": {"status": "moved"}}, seen, [], node="hosta")
    assert out["gone"] == ["pid 4242 (python3)"] and out["empty"] is True
    assert any(x.startswith("  GONE    pid 4242 (python3): runs neither on hosta nor on hostb") for x in out["lines"])


def test_a_held_source_is_named_with_what_settles_it_and_the_node_is_not_empty():
    seen = {"d-4242": {"source": journal("delivered", stopped=[4242]), "target": None,
                       "target_error": "Failed to connect to the host via ssh"},
            "d-5120": moved(5120)}
    out = drain_end(PLAN, {"d-4242": {"status": "held", "reason": "HELD: run recover.yml ..."}}, seen, [A], node="hosta")
    assert out["empty"] is False and out["held"] == ["pid 4242 (python3)"] and out["still"] == ["pid 4242 (python3)"]
    assert "  HELD    pid 4242 (python3) on hosta (stopped since its freeze): HELD: run recover.yml ..." in out["lines"]


def test_an_exited_held_source_is_not_on_the_node_and_still_keeps_it_from_being_empty():
    seen = {"d-4242": {"source": journal("delivered"), "target": None, "target_error": "unreachable"},
            "d-5120": moved(5120)}
    out = drain_end(PLAN, {}, seen, [], node="hosta")
    assert out["empty"] is False and out["still"] == ["pid 4242 (python3)"]
    assert "exited, its image on hosta is the way back" in out["lines"][1]


def test_a_node_that_cannot_be_asked_is_not_called_empty():
    out = drain_end(PLAN, {}, {"d-4242": moved(4242), "d-5120": moved(5120)}, None, node="hosta")
    assert out["empty"] is False
    assert out["lines"][-1].startswith("  ?       hosta could not be asked at the end")


def test_a_copy_the_node_sees_only_because_both_share_one_pid_space_is_not_the_nodes():
    """One kernel, one pid space: the node lists the committed copy (same pid, start time and boot) too."""
    copy = dict(proc(4242, start=900))
    out = drain_end(PLAN, {}, {"d-4242": moved(4242, start=900), "d-5120": moved(5120)}, [copy], node="hosta")
    assert out["empty"] is True
    # ... while another process that has the same pid on the node (another start time) is the node's.
    out = drain_end(PLAN, {}, {"d-4242": moved(4242, start=900), "d-5120": moved(5120)}, [proc(4242, start=5)],
                    node="hosta")
    assert out["empty"] is False


def test_a_move_of_an_earlier_drain_held_by_its_settlement_is_named_once_with_what_settles_it():
    plan = {"moves": [], "stays": [{"workload": A, "reason": "checkpoint API ... locked"}], "left_out": []}
    earlier = [{"migration_id": "old-4242", "target": "hostb", "workload": "process:4242"}]
    seen = {"old-4242": {"source": journal("delivered", stopped=[4242]), "target": journal("cleaned"), "target_error": ""}}
    out = drain_end(plan, {"old-4242": {"status": "held", "reason": "its copy ... gpuckpt_accept_rewind=true"}}, seen,
                    [A], node="hosta", earlier=earlier)
    assert out["lines"][1:] == ["  HELD    pid 4242 (python3) on hosta (stopped since its freeze; move old-4242 of an "
                                "earlier drain): its copy ... gpuckpt_accept_rewind=true"]
    assert out["empty"] is False


def test_a_job_that_ended_on_its_own_before_its_move_froze_it_is_not_lost():
    seen = {"d-4242": {"source": {"exists": False, "phase": None}, "target": journal("cleaned"), "target_error": ""},
            "d-5120": moved(5120)}
    out = drain_end(PLAN, {"d-4242": {"status": "stayed", "reason": "Preflight failed ..."}}, seen, [], node="hosta")
    assert out["gone"] == [] and out["empty"] is True
    assert out["lines"][1].startswith("  ENDED   pid 4242 (python3): no longer runs on hosta")


def test_a_move_of_an_earlier_drain_rolled_back_or_never_begun_leaves_its_job_to_this_plan():
    """A killed drain's re-run: one earlier move never froze its job, one was given back; this plan moved both."""
    earlier = [{"migration_id": "old-4242", "target": "hostb", "workload": "process:4242"},
               {"migration_id": "old-5120", "target": "hostc", "workload": "process:5120"}]
    seen = {"old-4242": {"source": {"exists": False, "phase": None}, "target": {"exists": False}, "target_error": ""},
            "old-5120": {"source": journal("resumed"), "target": journal("cleaned"), "target_error": ""},
            "d-4242": moved(4242), "d-5120": moved(5120)}
    out = drain_end(PLAN, {"old-5120": {"status": "stayed", "rewind": "the job was rolled back ..."}}, seen, [],
                    node="hosta", earlier=earlier)
    assert out["lines"][1] == "  SETTLED pid 4242 (move old-4242 of an earlier drain): it had not begun"
    assert out["lines"][2] == ("  SETTLED pid 5120 (move old-5120 of an earlier drain): rolled back to hosta; "
                               "the job was rolled back ...")
    assert out["empty"] is True and out["gone"] == []


def test_describe_key():
    assert report.describe_key("process:4242") == "pid 4242"
    assert report.describe_key("runc:train-7") == "container train-7 (runc)"
    assert report.describe_key("containerd:ns/c1") == "container c1 (containerd)"
    assert report.describe_key("k8s_pod:ml/trainer") == "pod ml/trainer"


# -- lost_copy ---------------------------------------------------------------------------------------------------

def settled(decision, **journal_fields):
    return {"decision": decision, "phase": "cleaned" if decision == "rollback" else "committed", "journal": journal_fields}


def test_a_target_that_could_not_be_asked_says_nothing():
    assert lost_copy({"unreachable": True, "msg": "x"})["known"] is False
    assert lost_copy({"failed": False, "msg": "lock busy"})["lost"] is False  # a settlement that raised


def test_a_target_cleaned_before_any_restore_lost_nothing():
    out = lost_copy(settled("rollback", identities={}, history=[{"phase": "cleaned", "time": 10.0}]))
    assert out == {"lost": False, "known": True, "since": None, "until": 10.0, "ran_s": None, "note": ""}


def test_a_copy_restored_and_dead_since_is_lost_with_how_long_it_ran_at_most():
    out = lost_copy(settled("rollback", identities={"7": {"pid": 7}}, resumed_at=1000.0,
                            history=[{"phase": "restored", "time": 1000.1}, {"phase": "cleaned", "time": 1012.5}]),
                    target="hostc")
    assert out["lost"] is True and out["ran_s"] == 12.5
    assert out["note"].startswith("its copy on hostc was brought up at 1970-01-01T00:16:40Z (its restore had unlocked it)")
    assert "(it ran for 12.5 s at most)" in out["note"]


def test_a_restore_whose_module_died_after_it_brought_the_copy_up_may_have_run():
    out = lost_copy(settled("rollback", identities={"7": {"pid": 7}},
                            history=[{"phase": "restoring", "time": 50.0}, {"phase": "cleaned", "time": 80.0}]))
    assert out["lost"] is True and out["since"] == 50.0 and out["ran_s"] == 30.0
    assert "whether it unlocked them the journal does not say" in out["note"]


def test_a_committed_copy_that_runs_is_not_lost_and_one_gone_since_is():
    assert lost_copy(settled("commit", alive_pids=[7], resumed_at=5.0))["lost"] is False
    out = lost_copy(settled("commit", alive_pids=[], resumed_at=5.0))
    assert out["lost"] is True and out["ran_s"] is None and "was committed and" in out["note"]
