"""core/procfs.py: the /proc readers that the journal, the runtimes and the facts share, read on this
test's own process (and on a pid that does not exist)."""
from __future__ import annotations

import os
import subprocess

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import journal, procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget

NO_PID = 4194303  # above the kernel's pid_max limit: never a process


def test_the_state_and_start_time_of_a_process_and_of_none():
    me = os.getpid()
    st = procfs.read_stat(me)
    assert procfs.process_state(me) == st["state"] == "R" and st["starttime"] > 0
    assert procfs.read_stat(NO_PID) is None and procfs.process_state(NO_PID) is None
    # the journal names processes by the same start time
    assert journal.process_identity(me)["starttime"] == st["starttime"]
    assert journal.process_identity(NO_PID) is None
    assert journal.process_identity(me)["boot_id"] == procfs.boot_id()


def test_boot_id_and_namespaces():
    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert procfs.boot_id() == fh.read().strip()
    assert procfs.pid_namespace().startswith("pid:[") and procfs.net_namespace().startswith("net:[")
    assert procfs.net_namespace(os.getpid()) == procfs.net_namespace()
    assert procfs.pid_namespace(NO_PID) is None and procfs.net_namespace(NO_PID) is None


def test_pid_inside_its_namespace_and_memory():
    me = os.getpid()
    assert procfs.ns_pid(me) == me  # this process sees itself from inside its own pid namespace
    assert procfs.ns_pid(NO_PID) is None
    assert procfs.rss_bytes(me) > 1 << 20 and procfs.rss_bytes(NO_PID) == 0
    mem = procfs.meminfo()
    assert 0 < mem["available_bytes"] <= mem["total_bytes"]


def test_the_unified_cgroup_of_a_process():
    with open("/proc/self/cgroup") as fh:
        v2 = [ln[3:].strip() or "/" for ln in fh if ln.startswith("0::")]
    assert procfs.unified_cgroup(os.getpid()) == (v2[0] if v2 else None)
    assert procfs.unified_cgroup(NO_PID) is None


def test_usable_cpus_are_the_affinity_cut_to_the_cgroup_quotas_rounded_up(tmp_path, monkeypatch):
    allowed = len(os.sched_getaffinity(0))
    monkeypatch.setattr(procfs, "unified_cgroup", lambda pid: "/pod/ctr")
    (tmp_path / "pod" / "ctr").mkdir(parents=True)
    assert procfs.usable_cpus(str(tmp_path)) == allowed, "no cpu.max anywhere: the affinity"
    (tmp_path / "pod" / "ctr" / "cpu.max").write_text("max 100000\n")
    assert procfs.usable_cpus(str(tmp_path)) == allowed
    (tmp_path / "pod" / "cpu.max").write_text("50000 100000\n")  # an ancestor's quota holds too
    assert procfs.usable_cpus(str(tmp_path)) == 1
    (tmp_path / "pod" / "cpu.max").write_text("garbage\n")
    (tmp_path / "pod" / "ctr" / "cpu.max").write_text("%d 100000\n" % (100000 * allowed - 1))
    assert procfs.usable_cpus(str(tmp_path)) == allowed, "a part of a core counts as one"


def _user_process_seen_as(monkeypatch, pid, ppid):
    """A real sleeper whose stat reads as ``pid`` with parent ``ppid``: how a container's own pid namespace shows
    its first processes (pid 2 there is a user process, and so are its children)."""
    sleeper = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, start_new_session=True)
    read_stat = procfs.read_stat
    monkeypatch.setattr(procfs, "read_stat", lambda p: dict(read_stat(sleeper.pid), pid=pid, ppid=ppid)
                        if p == pid else read_stat(p))
    # (in a CI container's own pid namespace, pid 2 or 7 may really be one of this test's parents, which
    # validate_target rightly refuses: that check is not this test's)
    monkeypatch.setattr(procfs, "ancestors", lambda p: set())
    return sleeper


def test_only_the_kernel_thread_flag_makes_a_kernel_thread(monkeypatch):
    for pid, ppid in ((2, 1), (7, 2)):
        sleeper = _user_process_seen_as(monkeypatch, pid, ppid)
        try:
            assert procfs.validate_target(pid)["comm"] == "sleep", "a container's pid %d is a user process" % pid
        finally:
            sleeper.kill()
            sleeper.wait()
            monkeypatch.undo()
    kernel_threads = [int(p) for p in os.listdir("/proc") if p.isdigit()
                      and (procfs.read_stat(int(p)) or {"flags": 0})["flags"] & procfs.PF_KTHREAD]
    if kernel_threads:  # none are seen from inside a pid namespace of its own
        with pytest.raises(InvalidTarget, match="kernel thread"):
            procfs.validate_target(kernel_threads[0])
