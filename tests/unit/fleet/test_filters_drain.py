"""The drain's filters as drain.yml calls them: thin wrappers over fleet/ and the planner, given registered
results and hostvars as Ansible hands them over."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.filter.drain_move_host import drain_move_host
from ansible_collections.gpuckpt.fleet.plugins.filter.drain_plan import drain_plan
from ansible_collections.gpuckpt.fleet.plugins.filter.drain_report import drain_report
from ansible_collections.gpuckpt.fleet.plugins.filter.migration_id_reuse import migration_id_reuse
from ansible_collections.gpuckpt.fleet.plugins.filter.option_errors import option_errors

GIB = 2**30
ROOT = "/var/lib/gpuckpt/images"


def host(name, free_gib=70, runtimes=("runc",)):
    return {"host": {"hostname": name}, "memory": {"available_bytes": 200 * GIB},
            "driver": {"available": True, "checkpoint_api": True, "driver_version": "580", "api_version": "13.0"},
            "gpus": [{"index": 0, "name": "H100", "uuid": "GPU-%s-0" % name, "memory_free_mib": free_gib * 1024}],
            "gpu_source": "nvml", "criu": {"version": "4.2.1", "supported": True, "check_ok": True},
            "disk": {ROOT: {"free_bytes": 500 * GIB}}, "pids_in_use": [], "runtimes_present": list(runtimes),
            "drain": None}


def workload(key, gpu_gib, pid):
    runtime, ident = key.split(":")
    tree = {"root": pid, "exists": True, "pids": [pid], "cuda_pids": [pid], "cuda_states": {str(pid): "running"},
            "rss_bytes": GIB, "gpu_bytes": gpu_gib * GIB, "gpu_bytes_by_gpu": {"GPU-node-0": gpu_gib * GIB}}
    w = {"key": key, "kind": "process" if runtime == "process" else "container", "runtime": runtime, "root_pid": pid,
         "tree": tree}
    w.update({"pid": pid} if runtime == "process" else {"container": ident})
    return w


NODE = dict(host("node"), workloads=[workload("process:4242", 10, 4242), workload("runc:train-7", 20, 900),
                                     workload("runc:huge", 79, 950)])


def registered(facts):
    return {"changed": False, "ansible_facts": {"gpuckpt": facts}}


def plan(**kw):
    kw.setdefault("targets", {"hostb": registered(host("hostb"))})
    return drain_plan(NODE, node="node", source_path=ROOT, target_paths={"hostb": ROOT, "hostc": ROOT, "hostd": ROOT},
                      id_prefix="drain-node-1", **kw)


def test_drain_plan_places_what_fits_and_says_why_the_rest_stays():
    p = plan()
    assert [(m["workload"]["key"], m["target"], m["migration_id"]) for m in p["moves"]] == [
        ("runc:train-7", "hostb", "drain-node-1-runc-train-7"), ("process:4242", "hostb", "drain-node-1-process-4242")]
    assert [(s["workload"]["key"], s["reason"]) for s in p["stays"]] == [("runc:huge", "fits on no target")]
    assert p["workloads"] == 3 and p["left_out"] == [] and p["pending_before"] == []
    assert p["pending"] == [{"migration_id": "drain-node-1-runc-train-7", "target": "hostb", "workload": "runc:train-7"},
                            {"migration_id": "drain-node-1-process-4242", "target": "hostb", "workload": "process:4242"}]
    assert p["lines"][0] == "Drain of node: 2 workload(s) to move, 1 to stay"


def test_drain_plan_takes_registered_results_raw_facts_and_hosts_without_facts():
    p = plan(targets={"hostb": host("hostb", free_gib=15), "hostc": {"unreachable": True, "msg": "ssh: timed out"},
                      "hostd": {"failed": True, "msg": "criu: not found"}, "hoste": "not asked",
                      "hostf": {"changed": False, "ansible_facts": {}}})
    rejected = p["moves"][0]["rejected"]
    assert p["moves"][0]["target"] == "hostb"
    assert rejected == {"hostc": "no facts: unreachable: ssh: timed out", "hostd": "no facts: its facts failed: criu: not found",
                        "hoste": "no facts: not asked", "hostf": "no facts: its facts failed: no facts"}


def test_drain_plan_include_and_exclude_leave_workloads_out_with_a_line_each():
    p = plan(include=["runc"], exclude=["huge"])
    assert [m["workload"]["key"] for m in p["moves"]] == ["runc:train-7"] and p["stays"] == []
    assert sorted((w["key"], w["reason"]) for w in p["left_out"]) == [
        ("process:4242", "not named by include (runc)"), ("runc:huge", "named by exclude")]
    assert p["workloads"] == 3
    assert "  LEFT  container huge (runc): named by exclude" in p["lines"]


def test_drain_plan_keeps_the_earlier_moves_that_did_not_settle():
    earlier = {"pending": [{"migration_id": "old-1", "target": "hostb", "workload": "runc:x"},
                           {"migration_id": "old-2", "target": "hostc", "workload": "runc:y"}],
               "settled": {"old-1": {"status": "moved"}, "old-2": {"status": "unsettled"}}}
    p = plan(earlier=earlier)
    assert p["pending_before"] == [earlier["pending"][1]]
    assert [r["migration_id"] for r in p["pending"]] == ["old-2", "drain-node-1-runc-train-7", "drain-node-1-process-4242"]


def test_drain_plan_with_a_deadline_and_throughput_as_the_node_recorded_it():
    p = plan(deadline="600", parallel="2", throughput={"hostb": {"bytes_s": 1e9, "measured_at": "x"}}, overhead="10")
    assert [m["batch"] for m in p["moves"]] == [0, 0]
    assert all(m["estimate"]["duration_s"] is not None for m in p["moves"])
    unknown = plan(deadline=600)
    assert unknown["moves"] == [] and all("allow it with gpuckpt_allow_unknown=[deadline]" in s["reason"]
                                          for s in unknown["stays"] if s["workload"]["key"] != "runc:huge")
    allowed = plan(deadline=600, allow_unknown=["deadline"])
    assert len(allowed["moves"]) == 2


@pytest.mark.parametrize("node_facts,kw,message", [
    ({"host": {}}, {}, "the node's facts hold no workloads"),
    (None, {}, "the node's facts hold no workloads"),
    (NODE, {"allow_unknown": ["gpu-memory", "disk"]}, "allow_unknown names no check: gpu-memory"),
])
def test_drain_plan_refuses_what_it_cannot_plan(node_facts, kw, message):
    with pytest.raises(AnsibleFilterError, match=message):
        drain_plan(node_facts, {}, "node", ROOT, {}, "d", **kw)


# -- drain_report ----------------------------------------------------------------------------------------

def test_drain_report_keys_outcomes_by_migration_id_and_keeps_what_did_not_settle():
    p = plan(earlier={"pending": [{"migration_id": "old-2", "target": "hostc", "workload": "runc:y"}], "settled": {}})
    outcomes = {  # as drain.yml collects them: by move host (its migration id), each naming its id
        "drain-node-1-runc-train-7": {"migration_id": "drain-node-1-runc-train-7", "status": "moved", "where": "hostb",
                                      "transfer_bytes_s": 8e8},
        "h2": {"migration_id": "drain-node-1-process-4242", "status": "stayed", "where": "node", "settled": False,
               "reason": "the target did not answer"},
        "junk": "not a dict",
    }
    r = drain_report(p, outcomes, node="node", throughput={"hostc": {"bytes_s": 1e9}}, now="T")
    assert r["empty"] is False
    assert [x["migration_id"] for x in r["pending"]] == ["old-2", "drain-node-1-process-4242"]
    assert r["throughput"] == {"hostb": {"bytes_s": 8e8, "measured_at": "T", "by": "drain-node-1-runc-train-7"},
                               "hostc": {"bytes_s": 1e9}}
    assert "  MOVED   container train-7 (runc) -> hostb" in r["lines"][1]
    assert r["lines"][2] == "  STAYED  pid 4242 on node: the target did not answer"
    assert r["lines"][3] == "  STAYED  container huge (runc) on node: fits on no target"


def test_drain_report_of_a_node_emptied():
    p = plan(exclude=["huge"])
    moved = {m["migration_id"]: {"status": "moved", "where": "hostb"} for m in p["moves"]}
    r = drain_report(p, moved, node="node")
    assert r["empty"] is False, "a workload left out by exclude is still on the node"
    p = plan(targets={"hostb": registered(host("hostb", free_gib=80)), "hostc": registered(host("hostc", free_gib=80))})
    assert p["stays"] == [] and len(p["moves"]) == 3
    r = drain_report(p, {m["migration_id"]: {"status": "moved", "where": "hostb"} for m in p["moves"]}, node="node")
    assert r["empty"] is True and r["pending"] == [] and r["throughput"] == {}


# -- drain_move_host -------------------------------------------------------------------------------------

NODE_VARS = {
    "inventory_hostname": "gpu-node-7", "group_names": ["gpu_nodes", "rack_3"],
    "ansible_host": "10.0.0.7", "ansible_port": 2222, "ansible_user": "ops", "ansible_connection": "ssh",
    "ansible_python_interpreter": "/usr/bin/python3", "ansible_ssh_private_key_file": "/k", "ansible_become": True,
    "ansible_password": "not copied", "ansible_hostname_alias": "not copied",
    "gpuckpt_image_root": "/data/images", "gpuckpt_runtime_timeout": 0, "gpuckpt_src_opts": {"runc_root": "/run/runc"},
    "gpuckpt_drain_node": "gpu-node-7", "gpuckpt_drain_node_facts": {"big": True}, "gpuckpt_mark_before": {},
    "gpuckpt_mark_read": {}, "gpuckpt_throughput": {}, "gpuckpt_throughput_read": {}, "gpuckpt_move_outcome": {},
}


def test_drain_move_host_copies_the_node_s_settings_but_not_the_drain_s_own_facts():
    out = drain_move_host(NODE_VARS, "m-1", group="gpuckpt_drain_moves", source="gpu-node-7", target="hostb",
                          migration_id="m-1")
    assert out == {"name": "m-1", "groups": ["gpuckpt_drain_moves", "gpu_nodes", "rack_3"],
                   "ansible_host": "10.0.0.7", "ansible_port": 2222, "ansible_user": "ops", "ansible_connection": "ssh",
                   "ansible_python_interpreter": "/usr/bin/python3", "ansible_ssh_private_key_file": "/k",
                   "ansible_become": True, "gpuckpt_image_root": "/data/images", "gpuckpt_runtime_timeout": 0,
                   "gpuckpt_src_opts": {"runc_root": "/run/runc"},
                   "source": "gpu-node-7", "target": "hostb", "migration_id": "m-1"}


def test_drain_move_host_copies_no_secret_and_leaves_unset_values_undefined():
    """add_host shows the vars it is given (-v, an AWX job's log): the signing key and the API server's credentials
    stay in the node's own hostvars, where the moves read them. A value not set (a move without a GPU map) is not
    given at all, so that the move sees it undefined, not null."""
    node = dict(NODE_VARS, gpuckpt_sign_key="s3cret", gpuckpt_k8s_auth={"api_key": "tok"})
    out = drain_move_host(node, "m-1", group="g", source="n", gpuckpt_gpu_map=None)
    assert "gpuckpt_sign_key" not in out and "gpuckpt_k8s_auth" not in out and "gpuckpt_gpu_map" not in out
    assert "s3cret" not in repr(out) and "tok" not in repr(out)
    assert drain_move_host({}, "m-1", group="g", workload={"kind": "pod", "pod": "ml/a"})["pod"] == "ml/a"


@pytest.mark.parametrize("workload,given", [
    ({"kind": "process", "pid": 4242, "runtime": "process"}, {"pid": 4242}),
    ({"kind": "container", "container": "train-7", "runtime": "runc"}, {"container": "train-7", "runtime": "runc"}),
    ({"kind": "container", "container": "job", "runtime": "containerd", "namespace": "k8s.io"},
     {"container": "job", "runtime": "containerd", "containerd_namespace": "k8s.io"}),
    (None, {}),
])
def test_drain_move_host_names_the_workload_as_migrate_yml_takes_it(workload, given):
    out = drain_move_host({"group_names": ["moves"]}, "m-1", group="moves", workload=workload, gpuckpt_settle_only=True)
    assert out == dict(given, name="m-1", groups=["moves"], gpuckpt_settle_only=True)


# -- option_errors and migration_id_reuse ----------------------------------------------------------------

def test_option_errors_filter():
    assert option_errors(None) == []
    assert option_errors({"drain_parallel": "0", "deadline": None}) == ["drain_parallel='0' must be a whole number of 1 or more"]


JOURNAL = {"exists": True, "phase": "committed", "pids": [4242], "identities": {"4242": {"starttime": 777}}}


@pytest.mark.parametrize("kw,refused", [
    (dict(pid=4242, pid_starttime="777"), False),
    (dict(pid=4242, pid_starttime=""), False),  # no process has the pid now
    (dict(pid=4242, pid_starttime=None), False),
    (dict(pid=4242, pid_starttime="999"), True),
    (dict(pid=5000, pid_starttime=""), True),
    (dict(pid=0, container="", pod=""), False),  # what drain.yml passes when nothing is named
    (dict(pid=0, container="train-7", pod=""), True),
])
def test_migration_id_reuse_filter(kw, refused):
    why = migration_id_reuse(JOURNAL, "m-42", **kw)
    assert isinstance(why, str) and bool(why) is refused
    assert migration_id_reuse(None, "m-42", **kw) == ""
