"""fleet/workloads.py: a node's GPU workloads as a drain moves them. /proc is a table here (a fake read_stat):
no process is looked at."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import workloads


def stat(pid, ppid, pgrp=100, tty=0, kthread=False, comm="python3", starttime=None):
    return {"pid": pid, "comm": comm, "state": "S", "ppid": ppid, "pgrp": pgrp, "session": 1, "tty_nr": tty,
            "flags": procfs.PF_KTHREAD if kthread else 0, "starttime": starttime or 1000 + pid}


def fake_proc(*stats):
    table = {s["pid"]: s for s in stats}
    return table.get


# A job script (pgrp 100, no tty) started from a login shell (pgrp 50, tty), itself under sshd (pid 10, ppid 1).
SSHD = stat(10, 1, pgrp=10, comm="sshd")
SHELL = stat(50, 10, pgrp=50, tty=34816, comm="bash")
LAUNCHER = stat(100, 50, pgrp=100, comm="torchrun")
WORKER = stat(101, 100, pgrp=100)


@pytest.mark.parametrize("case,stats,pid,root", [
    ("walks up the launcher of the same group", [SSHD, SHELL, LAUNCHER, WORKER], 101, 100),
    ("the root itself", [SSHD, SHELL, LAUNCHER, WORKER], 100, 100),
    ("stops below pid 1", [stat(200, 1), stat(201, 200), stat(202, 201)], 202, 200),
    ("stops at another process group", [stat(300, 299, pgrp=299), stat(299, 1, pgrp=299), stat(301, 300, pgrp=300)],
     301, 301),
    ("stops at a parent with a terminal", [stat(400, 1), stat(401, 400, tty=34817), stat(402, 401)], 402, 402),
    ("stops at a kernel thread", [stat(2, 0, kthread=True, comm="kthreadd"), stat(500, 2)], 500, 500),
    ("stops where the parent is gone", [stat(600, 599), stat(601, 600)], 601, 600),
    ("a pid that is gone is its own root", [], 700, 700),
])
def test_tree_root(case, stats, pid, root):
    assert workloads.tree_root(pid, fake_proc(*stats)) == root, case


def test_a_torchrun_tree_is_one_workload_though_each_rank_leads_a_session_of_its_own():
    """torchrun starts each rank in a new session: a rank (TORCHELASTIC_RUN_ID in its environment) walks up to its
    agent, and on from there as any process; a process of another session without it stays its own root."""
    agent = stat(800, 50, pgrp=800, comm="torchrun")
    ranks = [stat(801, 800, pgrp=801), stat(802, 800, pgrp=802)]
    helper = stat(803, 800, pgrp=803)  # (no elastic run in its environment)
    environ = {801: {"TORCHELASTIC_RUN_ID": "none", "RANK": "0"}, 802: {"TORCHELASTIC_RUN_ID": "none"}}.get
    proc = fake_proc(SSHD, SHELL, agent, helper, *ranks)
    assert [workloads.tree_root(p, proc, lambda pid: environ(pid) or {}) for p in (801, 802, 803)] == [800, 800, 803]
    facts = {"cuda_processes": [{"pid": 801, "exists": True}, {"pid": 802, "exists": True}]}
    found = workloads.from_facts(facts, tree_of_recorder()[0], proc, lambda pid: environ(pid) or {})
    assert [w["root_pid"] for w in found] == [800]
    # under a launcher of the same group, the rank walks on up through it
    under = fake_proc(SSHD, SHELL, LAUNCHER, stat(810, 100, pgrp=810))
    assert workloads.tree_root(810, under, lambda pid: {"TORCHELASTIC_RUN_ID": "x"} if pid == 810 else {}) == 100


def test_tree_root_takes_a_pid_given_as_text():
    assert workloads.tree_root("101", fake_proc(SSHD, SHELL, LAUNCHER, WORKER)) == 100


def tree_of_recorder():
    """tree_of double: records each call, answers a tree naming what it was asked."""
    calls = []

    def tree_of(root, pids):
        calls.append((root, pids))
        return {"root": root, "exists": True, "pids": list(pids or [root]), "cuda_pids": [root],
                "cuda_states": {str(root): "running"}, "rss_bytes": 1, "gpu_bytes": 2}
    return tree_of, calls


FACTS = {
    "gpu_containers": [
        {"id": "train-7", "pid": 900, "runtime": "runc", "status": "running", "pids": [900, 901],
         "cuda_processes": [{"pid": 901, "ns_pid": 2, "cuda_state": "running"}]},
        {"id": "sbx", "pid": 950, "runtime": "runsc", "status": "running", "pids": [950],
         "cuda_processes": [{"pid": 7, "ns_pid": 7, "cuda_state": "running", "in_sandbox": True},
                            {"pid": 9, "ns_pid": 9, "cuda_state": "locked", "in_sandbox": True}]},
        {"id": "infer", "pid": 980, "runtime": "containerd", "namespace": "ml-jobs", "status": "running",
         "pids": [980], "cuda_processes": [{"pid": 980, "ns_pid": 1, "cuda_state": "running"}]},
    ],
    "cuda_processes": [
        {"pid": 901, "exists": True, "container": {"runtime": "runc", "id": "train-7"}},
        {"pid": 980, "exists": True, "container": {"runtime": "containerd", "id": "infer", "namespace": "ml-jobs"}},
        {"pid": 7, "exists": True, "in_sandbox": True},
        {"pid": 101, "exists": True},
        {"pid": 102, "exists": True},
        {"pid": 4242, "exists": True},
        {"pid": 666, "exists": False},
    ],
}
PROC = fake_proc(SSHD, SHELL, LAUNCHER, WORKER, stat(102, 100), stat(4242, 1, pgrp=4242, comm="train.py"),
                 stat(900, 1, pgrp=900), stat(901, 900, pgrp=900), stat(980, 1, pgrp=980))


def test_from_facts_lists_containers_and_bare_trees_sorted_by_key():
    tree_of, calls = tree_of_recorder()
    found = workloads.from_facts(FACTS, tree_of, PROC)
    assert [w["key"] for w in found] == [
        "containerd:ml-jobs/infer", "process:100", "process:4242", "runc:train-7", "runsc:sbx"]
    by_key = {w["key"]: w for w in found}
    runc = by_key["runc:train-7"]
    assert (runc["kind"], runc["runtime"], runc["container"], runc["root_pid"]) == ("container", "runc", "train-7", 900)
    assert "namespace" not in runc
    infer = by_key["containerd:ml-jobs/infer"]
    assert (infer["container"], infer["namespace"]) == ("infer", "ml-jobs")
    # A container's tree is asked with the pids its runtime found.
    assert (900, [900, 901]) in calls and (980, [980]) in calls


def test_a_sandboxed_container_carries_the_sandbox_s_own_cuda_pids_and_states():
    tree_of, calls = tree_of_recorder()
    sbx = {w["key"]: w for w in workloads.from_facts(FACTS, tree_of, PROC)}["runsc:sbx"]
    assert (950, None) in calls  # the host's tree of the sandbox, not the in-sandbox pids
    assert sbx["tree"]["cuda_pids"] == [7, 9]
    assert sbx["tree"]["cuda_states"] == {"7": "running", "9": "locked"}
    assert sbx["tree"]["root"] == 950


def test_containerd_tasks_of_one_id_in_two_namespaces_are_two_workloads():
    tree_of, unused = tree_of_recorder()
    facts = {"gpu_containers": [
        {"id": "job", "pid": 980 + i, "runtime": "containerd", "namespace": ns, "pids": [980 + i],
         "cuda_processes": [{"pid": 980 + i, "cuda_state": "running"}]} for i, ns in enumerate(("default", "ml-jobs"))]}
    assert [w["key"] for w in workloads.from_facts(facts, tree_of, PROC)] == ["containerd:default/job", "containerd:ml-jobs/job"]


def test_bare_processes_are_grouped_by_their_root_and_container_ones_are_skipped():
    tree_of, calls = tree_of_recorder()
    found = workloads.from_facts(FACTS, tree_of, PROC)
    bare = [w for w in found if w["kind"] == "process"]
    assert [(w["pid"], w["root_pid"], w["comm"], w["starttime"]) for w in bare] == [
        (100, 100, "torchrun", 1100), (4242, 4242, "train.py", 5242)]
    assert all(w["runtime"] == "process" for w in bare)
    # One tree per root (workers 101 and 102 share 100), asked whole; no tree for 901, 980, 7 or the gone 666.
    assert sorted(c for c in calls if c[1] is None and c[0] != 950) == [(100, None), (4242, None)]


def test_from_facts_without_anything_is_empty():
    tree_of, calls = tree_of_recorder()
    assert workloads.from_facts({}, tree_of, PROC) == [] and calls == []
    assert workloads.from_facts({"gpu_containers": None, "cuda_processes": None}, tree_of, PROC) == []


def test_a_root_that_vanished_meanwhile_is_listed_without_its_name():
    tree_of, unused = tree_of_recorder()
    found = workloads.from_facts({"cuda_processes": [{"pid": 31, "exists": True}]}, tree_of, fake_proc())
    assert [(w["key"], w["comm"], w["starttime"]) for w in found] == [("process:31", None, None)]


def W(key, runtime, root, pids, container=None):
    return {"key": key, "runtime": runtime, "root_pid": root, "container": container, "tree": {"pids": pids}}


LIST = [W("process:100", "process", 100, [100, 101, 102]), W("runc:train-7", "runc", 900, [900, 901], "train-7"),
        W("podman:web", "podman", 950, [950], "web")]


@pytest.mark.parametrize("include,exclude,chosen", [
    (None, None, ["process:100", "runc:train-7", "podman:web"]),
    ([], [], ["process:100", "runc:train-7", "podman:web"]),
    (["runc"], None, ["runc:train-7"]),
    (["train-7", "web"], None, ["runc:train-7", "podman:web"]),
    (["101"], None, ["process:100"]),  # a pid of the tree names the workload
    ([100], None, ["process:100"]),  # a pid given as a number
    (None, ["process"], ["runc:train-7", "podman:web"]),
    (None, ["901"], ["process:100", "podman:web"]),
    (["runc", "podman"], ["web"], ["runc:train-7"]),
    (["nothing"], None, []),
])
def test_select(include, exclude, chosen):
    got, left = workloads.select(LIST, include, exclude)
    assert [w["key"] for w in got] == chosen
    assert sorted(w["key"] for w in left) == sorted(set(w["key"] for w in LIST) - set(chosen))


def test_select_says_why_each_is_left_out():
    unused, left = workloads.select(LIST, include=["runc", 4242], exclude=["train-7"])
    reasons = {w["key"]: w["reason"] for w in left}
    assert reasons["process:100"] == "not named by include (runc, 4242)"
    assert reasons["runc:train-7"] == "named by exclude"
    assert "reason" not in LIST[0]  # the workloads given are not changed


def test_a_kubernetes_pods_container_is_no_workload_but_named_and_a_device_holder_without_cuda_is_none():
    """containerd's namespace k8s.io is the kubelet's: its containers move with their pods, not behind the
    kubelet's back. A process that holds /dev/nvidia* but no CUDA context (nvidia-persistenced) is no workload
    when the driver answers; when it does not, it is listed (the planner's checkpoint API check says why)."""
    facts = {"gpu_containers": [{"id": "pod-ctr", "pid": 980, "runtime": "containerd", "namespace": "k8s.io",
                                 "pids": [980], "cuda_processes": [{"pid": 980, "cuda_state": "running"}]}],
             "cuda_processes": [{"pid": 980, "exists": True, "cuda_state": "running",
                                 "container": {"runtime": "containerd", "id": "pod-ctr", "namespace": "k8s.io"}},
                                {"pid": 100, "exists": True, "cuda_state": None}],
             "driver": {"available": True}}
    tree_of, unused = tree_of_recorder()
    assert workloads.from_facts(facts, tree_of, PROC) == []
    assert [c["id"] for c in workloads.pod_containers(facts)] == ["pod-ctr"]
    facts["driver"] = {"available": False}
    assert [w["key"] for w in workloads.from_facts(facts, tree_of, PROC)] == ["process:100"]


def test_a_pods_containers_are_one_workload_named_by_the_kubelets_labels():
    """Two CUDA containers of one pod move together (the pod path), with one tree over both; a pod's container
    without the kubelet's labels is left, named, not moved as a plain container."""
    def ctr(cid, pid, pod=None):
        labels = {} if pod is None else {"io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.name": pod,
                                         "io.kubernetes.pod.uid": "uid-" + pod}
        return {"id": cid, "pid": pid, "runtime": "containerd", "namespace": "k8s.io", "pids": [pid, pid + 1],
                "labels": labels, "cuda_processes": [{"pid": pid, "cuda_state": "running"}]}
    facts = {"gpu_containers": [ctr("c2", 990, "trainer"), ctr("c1", 980, "trainer"), ctr("c3", 970)],
             "cuda_processes": [], "driver": {"available": True}}
    tree_of, calls = tree_of_recorder()
    found = workloads.from_facts(facts, tree_of, PROC)
    assert [w["key"] for w in found] == ["k8s_pod:ml/trainer"]
    pod = found[0]
    assert (pod["kind"], pod["runtime"], pod["pod"], pod["pod_uid"]) == ("pod", "k8s_pod", "ml/trainer", "uid-trainer")
    assert pod["containers"] == ["c1", "c2"] and pod["root_pid"] == 980
    assert calls[-1] == (980, [980, 981, 990, 991])
    assert [c["id"] for c in workloads.pod_containers(facts)] == ["c3"]
    chosen, unused = workloads.select(found, include=["ml/trainer"])
    assert chosen == found
    chosen, unused = workloads.select(found, exclude=["c2"])
    assert chosen == []


def test_torchrun_ranks_in_sessions_of_their_own_move_with_their_agent():
    """torchrun starts each rank with start_new_session: a rank's walk up stops at the rank; its agent holds a CUDA
    context too (PyTorch 2.11), so the job is the agent's tree, one workload, not three."""
    tree_of, calls = tree_of_recorder()
    agent = stat(300, 1, pgrp=300, comm="python3")
    ranks = [stat(301, 300, pgrp=301, comm="pt_main_thread"), stat(302, 300, pgrp=302, comm="pt_main_thread")]
    facts = {"cuda_processes": [{"pid": p, "exists": True, "cuda_state": "running"} for p in (300, 301, 302)],
             "driver": {"available": True}}
    found = workloads.from_facts(facts, tree_of, fake_proc(agent, *ranks))
    assert [w["key"] for w in found] == ["process:300"]
    assert calls == [(300, None)]
