"""migration/plan.py: each decision of a migration's plan, with a probe double for the source host (its /proc, its
runtimes' backends): the runtime named, the root pid resolved, hold or exit and why, the id-reuse verdict, the pods
of a pod migration and the arguments of the later calls."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.pods import target_pod_name
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import plan
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.registry import RUNTIMES, backend_class

HOST = {"boot_id": "b1", "pid_namespace": "pid:[1]", "net_namespace": "net:[1]"}
OTHER = {"boot_id": "b2", "pid_namespace": "pid:[2]", "net_namespace": "net:[2]"}
# one kernel seen as two hosts, each in a pid namespace of its own (the loopback hosts of the integration tests)
SAME_KERNEL = {"boot_id": "b1", "pid_namespace": "pid:[9]", "net_namespace": "net:[1]"}


class Probe(object):
    """The source host as the plan reads it: a process table, the tree each runtime resolves, this host's identity."""

    def __init__(self, stats=None, resolved=None, host=None, fails=None):
        self.stats, self.resolved, self._host, self.fails = stats or {}, resolved or {}, host or HOST, fails
        self.asked = []

    def stat(self, pid):
        return self.stats.get(pid)

    def host(self):
        return self._host

    capabilities = staticmethod(plan.HostProbe.capabilities)
    target_pod_name = staticmethod(target_pod_name)

    def resolve(self, runtime, pid, container, pod):
        self.asked.append((runtime, pid, container, pod))
        if self.fails:
            raise RuntimeError(self.fails)
        return self.resolved.get(runtime, (int(pid or 0) or 4242, {"bound_sockets": []}))


def make(probe=None, journal=None, **params):
    params.setdefault("migration_id", "m-1")
    return plan.make(params, journal or {"exists": False}, probe or Probe())


def test_capabilities_are_the_backend_classes_own():
    for name in RUNTIMES:
        assert plan.HostProbe.capabilities(name) is backend_class(name).capabilities
    assert backend_class("no-such-runtime").__name__ == "ProcessBackend"


@pytest.mark.parametrize("runtime, target, sockets, hold, reason", [
    # a runtime that cannot hold a workload stopped exits, whatever the hosts
    ("podman", OTHER, [], False, "Podman cannot hold a container stopped"),
    ("docker", OTHER, [], False, "Docker cannot hold a container stopped"),
    # held: another kernel, or a container (its own pid namespace) on one kernel
    ("process", OTHER, ["tcp port 80"], True, ""),
    ("runc", SAME_KERNEL, [], True, ""),
    ("runc", HOST, [], True, ""),
    ("containerd", HOST, [], True, ""),
    ("runsc", HOST, [], True, ""),
    ("k8s_pod", HOST, [], True, ""),
    ("process", SAME_KERNEL, [], True, ""),
    # a bare tree restores its pids under their numbers: one pid space with a held source cannot
    ("process", HOST, [], False, "source and target share one pid space"),
    # a held source's bound sockets in the network namespace its copy would use
    ("process", SAME_KERNEL, ["tcp port 80", "unix @x"], False,
     "the workload holds tcp port 80, unix @x in the network namespace that its copy on hostb would use"),
    ("runc", SAME_KERNEL, ["tcp port 80"], False,
     "the workload holds tcp port 80 in the network namespace that its copy on hostb would use"),
    # the first reason wins
    ("podman", SAME_KERNEL, ["tcp port 80"], False, "Podman cannot hold a container stopped"),
])
def test_hold_or_exit(runtime, target, sockets, hold, reason):
    tree = {"bound_sockets": sockets, "net_namespace": "net:[1]"}
    got = plan.hold_or_exit(backend_class(runtime).capabilities, runtime, HOST, target, tree, "hostb")
    assert got[:2] == (hold, reason)
    assert got[2] == (target is HOST)


def test_sockets_in_another_network_namespace_do_not_clash():
    tree = {"bound_sockets": ["tcp port 80"], "net_namespace": "net:[7]"}
    assert plan.hold_or_exit(backend_class("runc").capabilities, "runc", HOST, SAME_KERNEL, tree)[:2] == (True, "")


def test_a_new_migration_is_planned_with_the_root_pid_and_the_later_calls():
    probe = Probe(resolved={"runc": (777, {"bound_sockets": []})})
    got = make(probe, container="c1", target_host=OTHER)
    assert got["settle"] is False and got["new"] is True
    assert got["runtime"] == "runc" and got["root_pid"] == 777 and got["workload"] == "container c1"
    assert got["hold_stopped"] is True and got["exit_reason"] == "" and got["error"] == ""
    assert got["restores_host_pids"] is False
    assert got["calls"]["source_facts"] == {"tree_of": 777}
    assert got["calls"]["checkpoint"] == {"runtime": "runc", "container": "c1", "leave_stopped": True}


def test_a_process_is_checkpointed_by_its_pid_and_its_pids_are_checked_on_the_target():
    got = make(pid=4242, target_host=HOST)
    assert got["runtime"] == "process" and got["root_pid"] == 4242 and got["restores_host_pids"] is True
    assert got["calls"]["checkpoint"] == {"runtime": "process", "pid": 4242, "leave_stopped": False}
    assert got["exit_reason"] == "source and target share one pid space" and got["one_pid_space"] is True


def test_a_pod_is_planned_with_its_pods_and_token():
    move_pod = {"namespace": "ns", "name": "p", "uid": "u-1", "node": "n1",
                "containers": [{"name": "a"}, {"name": "b"}]}
    got = make(pod="ns/p", move_pod=move_pod, target_host=OTHER)
    assert got["runtime"] == "k8s_pod" and got["pod_ref"] == {"namespace": "ns", "name": "p", "uid": "u-1"}
    assert got["target_pod"].startswith("p-") and len(got["restore_token"]) == 40
    assert got["calls"]["source_facts"] == {"container": "ns/p", "runtime": "k8s_pod"}
    assert got["calls"]["checkpoint"] == {"runtime": "k8s_pod", "pod": "ns/p", "pod_uid": "u-1",
                                          "pod_containers": ["a", "b"], "leave_stopped": True}
    assert make(pod="ns/p", move_pod=move_pod, target_pod_name="mine")["target_pod"] == "mine"


def test_a_pod_that_the_api_server_did_not_describe_is_not_planned():
    got = make(pod="ns/p", target_host=OTHER)
    assert got["root_pid"] is None and "not described" in got["error"]


def test_a_recovery_names_the_pod_its_journal_recorded():
    journal = {"exists": True, "runtime": "k8s_pod", "pod": {"namespace": "ns", "name": "p", "uid": "u"}}
    got = make(journal=journal)
    assert got["settle"] is True and got["pod_ref"] == journal["pod"] and got["target_pod"]
    assert make(journal={"exists": True, "runtime": "runc", "pod": journal["pod"]})["pod_ref"] is None


@pytest.mark.parametrize("given", [dict(), dict(pid=1, container="c"), dict(pid=0), dict(container="c", pod="n/p")])
def test_none_or_two_workloads_resolve_nothing(given):
    probe = Probe()
    got = make(probe, **given)
    assert got["new"] is True and got["root_pid"] is None and got["error"] == "" and probe.asked == []


def test_a_workload_that_cannot_be_resolved_is_said_not_raised():
    got = make(Probe(fails="no such container"), container="gone", runtime="docker", target_host=OTHER)
    assert got["root_pid"] is None and got["error"] == "container gone was not found on the source: no such container"
    assert "calls" in got and got["calls"] == {}


def test_settle_only_plans_no_new_migration():
    probe = Probe()
    got = make(probe, container="c1", settle_only=True)
    assert got["new"] is False and got["settle"] is False and probe.asked == []


def test_a_journal_on_either_host_settles_and_resolves_nothing():
    probe = Probe()
    assert make(probe, container="c1", target_journal={"exists": True})["settle"] is True
    assert make(probe, container="c1", journal={"exists": True, "container": "c1"})["settle"] is True
    assert probe.asked == []


JOURNAL = {"exists": True, "phase": "committed", "pids": [4242], "identities": {"4242": {"starttime": 100}}}


def test_a_rerun_with_the_same_workload_may_use_the_id():
    assert make(Probe(stats={4242: {"starttime": 100}}), journal=JOURNAL, pid=4242)["id_reuse"] == ""
    assert make(Probe(), journal=JOURNAL, pid=4242)["id_reuse"] == ""  # no process holds the pid now


def test_a_pid_that_another_process_holds_now_is_another_workload():
    got = make(Probe(stats={4242: {"starttime": 555}}), journal=JOURNAL, pid=4242)
    assert "was used before for pid 4242" in got["id_reuse"] and "another process holds it now" in got["id_reuse"]


def test_the_copy_on_the_target_holding_the_pid_is_the_same_workload():
    target_journal = {"exists": True, "identities": {"4242": {"starttime": 555}}}
    got = make(Probe(stats={4242: {"starttime": 555}}), journal=JOURNAL, pid=4242, target_journal=target_journal)
    assert got["id_reuse"] == ""


def test_another_container_is_refused():
    got = make(journal={"exists": True, "phase": "committed", "container": "c1", "runtime": "runc"}, container="c2")
    assert "was used before for container c1 (runc)" in got["id_reuse"]


def test_the_host_identity_reads_this_host():
    ident = plan.host_identity()
    assert set(ident) == {"boot_id", "pid_namespace", "net_namespace"} and ident["pid_namespace"].startswith("pid:")
