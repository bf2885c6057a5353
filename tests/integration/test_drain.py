"""drain.yml on three sshd "hosts" on loopback (127.0.0.12-14), each in its own pid namespace, with real ssh,
rsync-free pushes and CRIU: hosta is the node, hostb and hostc the targets. The GPU stage runs against the
libcuda TEST DOUBLE, and each host's GPU inventory and per-process GPU memory come from the nvidia-smi TEST
DOUBLE (tests/doubles/nvidia-smi), one JSON file per host: hostb has little free GPU memory, hostc a lot.

Every test ends with each workload running exactly once, counting on, its memory intact.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from helpers import ANSIBLE_PLAYBOOK, COLLECTIONS, COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, RuncOnLoopbackHosts, \
    write_runc_bundle
from loopback import LoopbackHosts
from loopback_workloads import RemoteWorkload, fakecuda_host_vars, processes

DRAIN = "gpuckpt.fleet.drain"
HOSTS = (("hosta", "127.0.0.12"), ("hostb", "127.0.0.13"), ("hostc", "127.0.0.14"))  # apart from the two-host tests
FREE_MIB = {"hosta": 81920, "hostb": 4096, "hostc": 81920}  # hostb cannot hold an 8 GiB job


@pytest.fixture(scope="module")
def hosts3(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hosts3"))
    host_vars = fakecuda_host_vars(base, names=[n for n, unused in HOSTS])
    for name in host_vars:
        host_vars[name].update({"gpuckpt_runc_root": os.path.join(base, name, "runc-root"),
                                "gpuckpt_runc_bundle": os.path.join(base, name, "bundle")})
    h = LoopbackHosts(base, hosts=HOSTS).start(host_vars)
    h.host_vars = host_vars
    yield h
    time.sleep(1)
    h.stop()


def smi_path(hosts, name):
    return hosts.host_vars[name]["gpuckpt_environment"]["GPUCKPT_FAKE_NVIDIA_SMI"]


def set_gpus(hosts, big=None, mapping=True):
    """Each host's GPU inventory (nvidia-smi TEST DOUBLE): its free memory, 1 MiB per libcuda-double process,
    and on hosta ``big`` ({pid: MiB}) more for those processes."""
    for name, unused in HOSTS:
        with open(smi_path(hosts, name)) as fh:
            spec = json.load(fh)
        spec["gpus"][0]["memory.free"] = FREE_MIB[name]
        spec["compute_apps"] = [{"pid": p, "gpu_uuid": spec["gpus"][0]["uuid"], "used_memory": mib}
                                for p, mib in (big or {}).items()] if name == "hosta" else []
        if mapping:
            spec["apps_mapping"] = {"path": FAKE_LIBCUDA, "gpu_uuid": spec["gpus"][0]["uuid"], "used_memory": 1}
        else:
            spec.pop("apps_mapping", None)
        with open(smi_path(hosts, name), "w") as fh:
            json.dump(spec, fh)


@pytest.fixture
def drain(playbook, hosts3):
    def run(extra=None, **kw):
        v = {"node": "hosta"}
        v.update(extra or {})
        return playbook(DRAIN, v, inventory=hosts3.path("inventory.yml"), **kw)
    return run


@pytest.fixture
def started(hosts3, tmp_path):
    """Workloads started on hosta, killed wherever they run at the end; the node's drain mark removed."""
    made = []

    def start(**kw):
        w = RemoteWorkload(hosts3, "hosta", str(tmp_path / ("w%d" % len(made))), **kw)
        made.append(w)
        return w

    yield start
    for w in made:
        w.kill()
    for name, unused in HOSTS:
        for f in ("drain.json", "throughput.json"):
            try:
                os.unlink(hosts3.path(name, "journal", f))
            except OSError:
                pass
    set_gpus(hosts3)


def where(hosts, w):
    """The host whose pid namespace runs the workload's parent."""
    pid = processes(w.dir)[0][0]
    ns = os.readlink("/proc/%d/ns/pid" % pid)
    for name, unused in HOSTS:
        if hosts.ssh(name, "readlink /proc/self/ns/pid").stdout.strip() == ns:
            return name
    return None


def lines(run, task):
    return run.task(task)["msg"]


def test_check_mode_prints_the_plan_and_the_drain_moves_each_workload_where_it_fits(drain, hosts3, started):
    """An 8 GiB job cannot go to hostb (4 GiB free): the plan puts it on hostc and the small one on hostb.
    --check prints that plan and freezes nothing; the drain then moves both, and the node is empty."""
    big, small = started(), started()
    set_gpus(hosts3, big={big.pid: 8192})
    before = {w: w.counts() for w in (big, small)}

    check = drain(check=True)
    assert check.rc == 0, check.stdout
    plan = "\n".join(lines(check, "The plan"))
    assert "MOVE  pid %d" % big.pid in plan and "-> hostc" in plan.split("pid %d" % big.pid)[1].split("\n")[0], plan
    assert "-> hostb" in plan.split("MOVE  pid %d" % small.pid)[1].split("\n")[0], plan
    assert "not on hostb: free GPU memory on target" in plan, plan
    assert "nothing was frozen" in plan
    assert where(hosts3, big) == where(hosts3, small) == "hosta"
    assert not os.path.exists(hosts3.path("hosta", "journal", "drain.json")), "--check writes no mark"
    for w in (big, small):
        assert w.one_copy_runs_intact()

    run = drain()
    assert run.rc == 0, run.stdout
    report = "\n".join(lines(run, "Where each workload runs now"))
    assert "MOVED   pid %d" % big.pid in report and "MOVED   pid %d" % small.pid in report, report
    assert where(hosts3, big) == "hostc" and where(hosts3, small) == "hostb"
    for w in (big, small):
        assert w.one_copy_runs_intact()
        assert w.counts()["parent"] > before[w]["parent"]
    with open(hosts3.path("hosta", "journal", "drain.json")) as fh:
        mark = json.load(fh)
    assert mark["empty"] is True and mark["pending"] == [], mark

    again = drain()
    assert again.rc == 0, again.stdout
    assert "0 workload(s) to move" in "\n".join(lines(again, "The plan"))
