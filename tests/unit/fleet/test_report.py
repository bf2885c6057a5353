"""fleet/report.py: a drain's plan and its outcome as lines for people, whether the node is empty, and what
the node's drain mark keeps between runs (the moves not settled, the throughput each target showed)."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import report

GIB = 2**30
RUNC = {"key": "runc:train-7", "kind": "container", "runtime": "runc", "container": "train-7", "root_pid": 900,
        "tree": {"rss_bytes": 2 * GIB, "gpu_bytes": 20 * GIB}}
BARE = {"key": "process:4242", "kind": "process", "runtime": "process", "pid": 4242, "root_pid": 4242, "comm": "train.py",
        "tree": {"rss_bytes": 1 * GIB, "gpu_bytes": None}}
SMALL = {"key": "process:77", "kind": "process", "runtime": "process", "pid": 77, "root_pid": 77,
         "tree": {"rss_bytes": GIB, "gpu_bytes": GIB}}
PLAN = {
    "moves": [{"workload": RUNC, "target": "hostb", "gpus": ["GPU-b-0"], "image_estimate_bytes": 24 * GIB, "batch": 0,
               "estimate": {"transfer_s": 25.8, "duration_s": 55.8, "finish_s": 55.8}, "migration_id": "d-runc-train-7",
               "rejected": {"hostc": "fits too; hostb was chosen (fewer moves planned there, or more free GPU memory)"}},
              {"workload": SMALL, "target": "hostc", "gpus": [], "image_estimate_bytes": 2 * GIB, "batch": 1,
               "estimate": {"transfer_s": None, "duration_s": None}, "migration_id": "d-process-77", "rejected": {}}],
    "stays": [{"workload": BARE, "reason": "fits on no target",
               "rejected": {"hostb": "free GPU memory on target: the workload's GPU memory is not known",
                            "hostc": "no facts: unreachable: timed out"}}],
}


@pytest.mark.parametrize("workload,text", [
    (RUNC, "container train-7 (runc)"), (BARE, "pid 4242 (train.py)"), (SMALL, "pid 77"),
    ({"kind": "container", "container": "x", "runtime": "containerd", "namespace": "k8s.io"}, "container x (containerd)"),
])
def test_describe(workload, text):
    assert report.describe(workload) == text


def test_plan_lines_name_each_move_each_stay_and_why_each_other_target_was_not_chosen():
    lines = report.plan_lines("node-7", PLAN)
    assert lines[0] == "Drain of node-7: 2 workload(s) to move, 1 to stay"
    assert lines[1] == ("  MOVE  container train-7 (runc) [24.0 GiB image, GPU 20.0 GiB] -> hostb GPU GPU-b-0 "
                        "(batch 0, est. 56 s, ends by 56 s) id d-runc-train-7")
    assert lines[2] == "  MOVE  pid 77 [2.0 GiB image, GPU 1.0 GiB] -> hostc (batch 1) id d-process-77"
    assert lines[3].startswith("  STAY  pid 4242 (train.py) [") and "GPU UNKNOWN]: fits on no target" in lines[3]
    assert lines[4:] == [
        "        container train-7 (runc) not on hostc: fits too; hostb was chosen (fewer moves planned there, or more "
        "free GPU memory)",
        "        pid 4242 (train.py) not on hostb: free GPU memory on target: the workload's GPU memory is not known",
        "        pid 4242 (train.py) not on hostc: no facts: unreachable: timed out"]


def test_plan_lines_of_a_node_without_workloads():
    assert report.plan_lines("n", {"moves": [], "stays": []}) == ["Drain of n: 0 workload(s) to move, 0 to stay"]


def test_a_late_move_kept_as_a_stay_shows_its_image_estimate():
    late = dict(PLAN["moves"][0], reason="estimated to end 120 s after the drain began, past the deadline of 100 s")
    line = report.plan_lines("n", {"moves": [], "stays": [late]})[1]
    assert line == ("  STAY  container train-7 (runc) [24.0 GiB image, GPU 20.0 GiB]: estimated to end 120 s after the "
                    "drain began, past the deadline of 100 s")


MOVED = {"status": "moved", "where": "hostb", "downtime_s": 12.3, "took_s": 61.0, "image_bytes": 23 * GIB}


def test_report_lines_show_where_each_runs_now_and_why_the_others_stayed():
    outcomes = {"d-runc-train-7": MOVED,
                "d-process-77": {"status": "stayed", "where": "node-7", "reason": "restore failed: rolled back"}}
    assert report.report_lines("node-7", PLAN, outcomes) == [
        "Drain of node-7:",
        "  MOVED   container train-7 (runc) -> hostb: downtime 12 s, move took 61 s (estimated 56 s), image 23.0 GiB "
        "(estimated 24.0 GiB)",
        "  STAYED  pid 77 on node-7: restore failed: rolled back",
        "  STAYED  pid 4242 (train.py) on node-7: fits on no target"]


def test_report_lines_of_a_move_that_did_not_report_or_gave_no_reason():
    lines = report.report_lines("node-7", PLAN, {"d-process-77": {"status": "unsettled", "where": None}})
    assert lines[1] == "  STAYED  container train-7 (runc) on node-7: the move did not report (its host failed?)"
    assert lines[2] == "  STAYED  pid 77 on node-7: unsettled"
    moved_unmeasured = report.report_lines("n", PLAN, {"d-process-77": {"status": "moved", "where": "hostc"}})[2]
    assert moved_unmeasured == "  MOVED   pid 77 -> hostc: downtime ?, move took ? (estimated ?), image ? (estimated 2.0 GiB)"


@pytest.mark.parametrize("plan,outcomes,left_out,empty", [
    ({"moves": PLAN["moves"], "stays": []}, {"d-runc-train-7": MOVED, "d-process-77": MOVED}, [], True),
    ({"moves": PLAN["moves"], "stays": []}, {"d-runc-train-7": MOVED}, [], False),
    ({"moves": PLAN["moves"], "stays": []}, {"d-runc-train-7": MOVED, "d-process-77": {"status": "stayed"}}, [], False),
    ({"moves": PLAN["moves"], "stays": []}, {"d-runc-train-7": MOVED, "d-process-77": MOVED}, [BARE], False),
    (PLAN, {"d-runc-train-7": MOVED, "d-process-77": MOVED}, [], False),
    ({"moves": [], "stays": []}, {}, [], True),
    ({"moves": [], "stays": []}, {}, (w for w in [BARE]), False),  # left_out may be any iterable
])
def test_node_empty(plan, outcomes, left_out, empty):
    assert report.node_empty(plan, outcomes, left_out) is empty


def test_move_record_keeps_the_id_the_target_and_the_workload_s_key():
    assert report.move_record(PLAN["moves"][0]) == {"migration_id": "d-runc-train-7", "target": "hostb",
                                                    "workload": "runc:train-7"}


@pytest.mark.parametrize("outcome,final", [
    (None, False), ({}, False),
    ({"status": "moved"}, True), ({"status": "stayed"}, True), ({"status": "none"}, True),
    ({"status": "stayed", "settled": False}, False),  # its target did not answer: not shown clean
    ({"status": "moved", "settled": True}, True),
    ({"status": "unsettled"}, False), ({"status": "not run"}, False),
])
def test_settled(outcome, final):
    assert report.settled(outcome) is final


def test_unsettled_keeps_the_records_without_a_final_outcome_in_their_order():
    records = [{"migration_id": i, "target": "hostb", "workload": "k"} for i in ("a", "b", "c", "d")]
    outcomes = {"a": {"status": "moved"}, "b": {"status": "unsettled"}, "d": {"status": "stayed", "settled": False}}
    assert [r["migration_id"] for r in report.unsettled(records, outcomes)] == ["b", "c", "d"]
    assert report.unsettled(records, None) == records
    assert report.unsettled([], outcomes) == []


def test_throughput_update_records_what_each_move_showed_the_latest_to_a_target_winning():
    plan = {"moves": [{"migration_id": "m1", "target": "hostb"}, {"migration_id": "m2", "target": "hostb"},
                      {"migration_id": "m3", "target": "hostc"}, {"migration_id": "m4", "target": "hostd"}]}
    before = {"hostc": {"bytes_s": 5e8, "measured_at": "earlier"}, "hoste": {"bytes_s": 1e9, "measured_at": "earlier"}}
    outcomes = {"m1": {"transfer_bytes_s": 1e9}, "m2": {"transfer_bytes_s": "2000000000"}, "m3": {"status": "stayed"},
                "m4": {"transfer_bytes_s": 0}}
    got = report.throughput_update(before, plan, outcomes, now="2026-11-25T15:00:00Z")
    assert got == {"hostb": {"bytes_s": 2e9, "measured_at": "2026-11-25T15:00:00Z", "by": "m2"},
                   "hostc": before["hostc"], "hoste": before["hoste"]}
    assert before == {"hostc": {"bytes_s": 5e8, "measured_at": "earlier"},
                      "hoste": {"bytes_s": 1e9, "measured_at": "earlier"}}, "what was recorded is not changed"


def test_throughput_update_without_anything_recorded_or_moved():
    assert report.throughput_update(None, {}, None) == {}
    assert report.throughput_update({"hostb": 1}, {"moves": []}, {}) == {"hostb": 1}
