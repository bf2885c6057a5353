"""Transparent huge pages held for an operation's duration, on a stand-in sysfs file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import hugepages
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import process_identity


def _sysfs(tmp_path, mode="madvise"):
    path = tmp_path / "enabled"
    path.write_text("always [%s] never\n" % mode if mode != "custom" else mode)
    return str(path)


def test_set_for_the_operation_and_put_back(tmp_path):
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "run" / "thp")
    with hugepages.HugePages(True, sysfs, state) as thp:
        assert hugepages.read_mode(sysfs) == "always"
        assert thp.report == {"requested": True, "mode": "always", "previous": "madvise"}
    assert hugepages.read_mode(sysfs) == "madvise"
    assert thp.report["put_back"] == "madvise"
    assert sorted(os.listdir(state)) == ["lock"]
    assert os.stat(state).st_mode & 0o777 == 0o700


def test_not_wanted_changes_nothing(tmp_path):
    sysfs, state = _sysfs(tmp_path, "never"), str(tmp_path / "thp")
    with hugepages.HugePages(False, sysfs, state) as thp:
        assert hugepages.read_mode(sysfs) == "never"
    assert thp.report is None and not os.path.exists(state)


def test_overlapping_operations_share_it_and_the_last_puts_it_back(tmp_path):
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "thp")
    first = hugepages.HugePages(True, sysfs, state).__enter__()
    # A second holder (another module on this host: here, a live child process's identity).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = process_identity(child.pid)
        with open(os.path.join(state, "holder-%d-%d" % (child.pid, ident["starttime"])), "w") as fh:
            json.dump(ident, fh)
        first.__exit__(None, None, None)
        assert hugepages.read_mode(sysfs) == "always"  # the other still holds it
        assert hugepages.settle(sysfs, state) is None
        assert hugepages.read_mode(sysfs) == "always"
    finally:
        child.kill()
        child.wait()
    # The other was killed without leaving: the next operation (wanting it or not) puts it back.
    with hugepages.HugePages(False, sysfs, state) as thp:
        assert hugepages.read_mode(sysfs) == "madvise"
    assert "put back to madvise" in thp.report["note"]


def test_a_killed_holder_is_settled_and_a_reused_pid_is_not_a_holder(tmp_path):
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "thp")
    code = ("import os, sys, time; sys.path[:0] = %r\n"
            "from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import hugepages\n"
            "h = hugepages.HugePages(True, %r, %r).__enter__()\n"
            "print('held', flush=True); time.sleep(60)\n" % (sys.path, sysfs, state))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    assert hugepages.read_mode(sysfs) == "always"
    proc.kill()  # SIGKILL: no exit handler runs
    proc.wait()
    # Its pid is reused by a process of ours: the holder's start time names another process.
    holder = [n for n in os.listdir(state) if n.startswith("holder-")]
    assert len(holder) == 1
    ident = json.load(open(os.path.join(state, holder[0])))
    ident["pid"] = os.getpid()
    json.dump(ident, open(os.path.join(state, holder[0]), "w"))
    assert "put back" in hugepages.settle(sysfs, state)
    assert hugepages.read_mode(sysfs) == "madvise"
    assert hugepages.settle(sysfs, state) is None


def test_an_administrators_change_meanwhile_is_kept(tmp_path):
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "thp")
    with hugepages.HugePages(True, sysfs, state):
        with open(sysfs, "w") as fh:
            fh.write("always madvise [never]\n")
    assert hugepages.read_mode(sysfs) == "never"


def test_a_host_without_thp_runs_the_operation_and_says_why(tmp_path):
    with hugepages.HugePages(True, str(tmp_path / "missing"), str(tmp_path / "thp")) as thp:
        pass
    assert "not available on this host" in thp.report["error"]
    assert not os.path.exists(tmp_path / "thp")


def test_already_always_is_left_always(tmp_path):
    sysfs, state = _sysfs(tmp_path, "always"), str(tmp_path / "thp")
    with hugepages.HugePages(True, sysfs, state) as thp:
        pass
    assert hugepages.read_mode(sysfs) == "always" and thp.report["previous"] == "always"


def test_check_mode_leaves_a_stale_setting_to_a_real_run(tmp_path):
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "thp")
    hugepages.HugePages(True, sysfs, state).__enter__()  # its holder "dies": this process is it, so fake one
    for name in os.listdir(state):
        if name.startswith("holder-"):
            os.unlink(os.path.join(state, name))
    with hugepages.HugePages(False, sysfs, state, settle_stale=False):
        pass
    assert hugepages.read_mode(sysfs) == "always"  # check mode changed nothing
    with hugepages.HugePages(False, sysfs, state):
        pass
    assert hugepages.read_mode(sysfs) == "madvise"


def test_a_holder_of_another_pid_namespace_is_not_pruned_from_this_one(tmp_path):
    """A process of another pid namespace (its own /proc) cannot see whether the holder lives: it keeps the holder
    and the setting, instead of putting the setting back under the holder's running operation."""
    sysfs, state = _sysfs(tmp_path), str(tmp_path / "thp")
    first = hugepages.HugePages(True, sysfs, state).__enter__()
    holder = first.holder
    with open(holder) as fh:
        ident = json.load(fh)
    assert ident["pid_ns"] == os.readlink("/proc/self/ns/pid")
    # The same record as a process of another namespace reads it: a pid that its /proc does not have.
    with open(holder, "w") as fh:
        json.dump(dict(ident, pid=2 ** 22 + 7, pid_ns="pid:[1]"), fh)
    assert hugepages.settle(sysfs, state) is None
    assert hugepages.read_mode(sysfs) == "always" and os.path.exists(holder)
    # Of this namespace and gone: pruned, and the setting put back.
    with open(holder, "w") as fh:
        json.dump(dict(ident, pid=2 ** 22 + 7), fh)
    assert "put back to madvise" in hugepages.settle(sysfs, state)
    assert hugepages.read_mode(sysfs) == "madvise"
