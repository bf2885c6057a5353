"""The bare process tree's runtime (runtimes/process.py): what it decides before CRIU runs (the tree, whether it is
a shell job, a session whose leader CRIU cannot see), what it tells CRIU, and that its resume and kill pass over a
pid that is already gone. Real sleeping processes are the workload; a TEST DOUBLE stands in for CRIU."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import process


class FakeCriu(object):
    """TEST DOUBLE of runtimes.criu.Criu: records each dump and restore; the restore 'brings up' ``restored``."""
    restored = None

    def __init__(self, path=None):
        self.path, self.calls = path, []

    def dump(self, pid, images_dir, work_dir, **options):
        self.calls.append(("dump", pid, options))

        class Result(object):
            seconds = 1.25
        return Result()

    def restore(self, images_dir, work_dir, **options):
        self.calls.append(("restore", options))
        return FakeCriu.restored, None


@pytest.fixture
def fake_criu(monkeypatch):
    monkeypatch.setattr(process, "Criu", FakeCriu)
    return FakeCriu


def _sleeper(**popen):
    return subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, **popen)


@pytest.fixture
def sleepers():
    started = []

    def start(**popen):
        p = _sleeper(**popen)
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()
        p.wait()


def test_a_tree_in_its_own_session_is_no_shell_job_and_its_dump_says_so(fake_criu, sleepers):
    own = sleepers(start_new_session=True)
    backend = process.ProcessBackend(criu_options=["--tcp-close"], timeout=30)
    assert backend.resolve(str(own.pid)) == (own.pid, [own.pid])
    out = backend.dump(own.pid, "/img", "/work", "exit")
    assert out == {"backend": "process", "root_pid": own.pid, "shell_job": False, "criu_options": ["--tcp-close"],
                   "auto_flags": [], "criu_seconds": 1.25}
    assert backend.criu.calls == [("dump", own.pid, {"after": "exit", "shell_job": False, "extra": ["--tcp-close"],
                                                     "timeout": 30})]


@pytest.fixture
def sleeper_led_from_outside():
    """A sleeper whose session and process group are led by its parent shell, which this test starts in a new
    session: the leader lives in this pid namespace but outside the sleeper's tree. (This test's own session
    cannot serve: under a CI runner its leader may sit outside the pid namespace, where it reads 0.)"""
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        yield int(leader.stdout.readline())
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        leader.stdout.close()


def test_a_tree_whose_session_leader_is_outside_it_is_a_shell_job(fake_criu, sleeper_led_from_outside):
    """The sleeper's session and process group are its parent's: CRIU must take them as external (--shell-job)."""
    pid = sleeper_led_from_outside
    stat = procfs.read_stat(pid)
    assert stat["session"] not in (0, pid) and stat["pgrp"] not in (0, pid)
    backend = process.ProcessBackend()
    assert backend.resolve(pid) == (pid, [pid])
    assert backend.dump(pid, "/img", "/work", "running")["shell_job"] is True
    assert backend.criu.calls[0][2]["shell_job"] is True


def test_a_session_led_from_another_pid_namespace_is_refused_before_anything(fake_criu, sleepers, monkeypatch):
    own = sleepers(start_new_session=True)
    read_stat = procfs.read_stat

    def session_zero(pid):
        # (a process of this busy machine that ends between the listing of /proc and the read of its stat reads as
        # None, as it does unpatched: a CI run failed on `dict(None)` once)
        st = read_stat(pid)
        return None if st is None else dict(st, session=0)

    monkeypatch.setattr(procfs, "read_stat", session_zero)
    backend = process.ProcessBackend()
    with pytest.raises(InvalidTarget, match="session or process-group leader outside this pid namespace") as err:
        backend.resolve(own.pid)
    assert err.value.pid == own.pid and "setsid" in err.value.hint
    assert backend.criu.calls == [], "CRIU was never asked"


def test_a_target_that_is_not_a_process_is_refused(fake_criu):
    with pytest.raises(InvalidTarget):
        process.ProcessBackend().resolve(2 ** 22 + 1)


def test_the_restore_takes_the_shell_job_and_flags_the_image_recorded(fake_criu, sleepers):
    restored = sleepers(start_new_session=True)
    fake_criu.restored = restored.pid
    backend = process.ProcessBackend(criu_options=["--tcp-close"])
    manifest = {"runtime": {"shell_job": True, "auto_flags": ["--file-locks"]}}
    assert backend.restore("/img", "/work", manifest, gate="the gate") == [restored.pid]
    assert backend.criu.calls == [("restore", {"shell_job": True, "extra": ["--tcp-close", "--file-locks"],
                                               "timeout": None, "gate": "the gate"})]


def test_the_capabilities_say_host_pids_and_a_gate():
    caps = process.ProcessBackend.capabilities
    assert caps.restores_host_pids is True and caps.gates_restore is True


def test_resume_and_kill_pass_over_a_pid_that_is_gone(fake_criu, sleepers):
    stopped, gone = sleepers(), sleepers()
    gone.kill()
    gone.wait()
    os.kill(stopped.pid, signal.SIGSTOP)
    backend = process.ProcessBackend()
    backend.resume([gone.pid, stopped.pid])
    deadline = time.monotonic() + 5
    while procfs.process_state(stopped.pid) in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert procfs.process_state(stopped.pid) not in ("T", "t"), "SIGCONT reached the stopped process"
    reaper = threading.Thread(target=stopped.wait)  # (the kill waits until the pid is gone: a zombie is not)
    reaper.start()
    backend.kill([gone.pid, stopped.pid])
    reaper.join(5)
    assert stopped.returncode == -signal.SIGKILL
