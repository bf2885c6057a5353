"""migrate.yml between two loopback hosts that share one pid space (one kernel, no pid namespaces).

There the target cannot restore the workload's pids while the source holds them stopped, so the
source exits after its dump and its own image is the way back. This runs that path in CI: a move,
and a restore that fails on the target and is rolled back by restoring the source from its image.
The GPU stage runs against the libcuda TEST DOUBLE.
"""
from __future__ import annotations

import os

import pytest

from loopback import LoopbackHosts
from loopback_workloads import RemoteWorkload, changed_tasks, fakecuda_host_vars, migrate, restore_fails_on


@pytest.fixture(scope="module")
def flat_hosts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("flat-hosts"))
    host_vars = fakecuda_host_vars(base)
    h = LoopbackHosts(base, pid_namespaces=False).start(host_vars)
    yield h
    h.stop()


@pytest.fixture
def flat_workload(flat_hosts, tmp_path):
    started = []

    def start():
        w = RemoteWorkload(flat_hosts, "hosta", str(tmp_path / ("w%d" % len(started))))
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def test_one_pid_space_move(playbook, flat_hosts, flat_workload):
    w = flat_workload()
    run = migrate(playbook, flat_hosts, w, "flat-move")
    assert run.rc == 0, run.stdout
    assert run.task("Stage 1/3")["leave_stopped"] is False  # the source exits: its pids must be free
    assert "share one pid space" in "\n".join(run.task("Show the preflight")["msg"])
    assert w.one_copy_runs_intact()


def test_one_pid_space_failed_restore_rolls_back_from_the_source_image(playbook, flat_hosts, flat_workload):
    w = flat_workload()
    inject = flat_hosts.path("hostb", "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("restore 0 2\n")  # CUDA_ERROR_OUT_OF_MEMORY on every restore on the target only
    try:
        run = migrate(playbook, flat_hosts, w, "flat-fail")
    finally:
        os.unlink(inject)
    assert run.rc != 0
    back = run.task("Resume the source")
    assert back["changed"] is True and "restored from its image" in back["msg"]
    assert "runs on hosta" in run.task("Migration failed and was rolled back")["msg"]
    assert w.one_copy_runs_intact()
    again = migrate(playbook, flat_hosts, w, "flat-fail")
    assert again.rc == 0 and changed_tasks(again) == []
    assert w.one_copy_runs_intact()


def test_one_pid_space_failed_restore_rolls_back_from_the_source_image_in_memory(playbook, flat_hosts, flat_workload):
    """The source exits after its dump here, so its image is the way back: kept in memory
    (gpuckpt_image_in_memory, issue 32), it is there until the settlement restores the source from it."""
    w = flat_workload()
    with restore_fails_on(flat_hosts):
        run = migrate(playbook, flat_hosts, w, "flat-mem-fail", gpuckpt_image_in_memory=True)
    assert run.rc != 0
    assert run.task("Stage 1/3")["image_in_memory"]["used_bytes"] > 0
    back = run.task("Resume the source")
    assert back["changed"] is True and "restored from its image" in back["msg"]
    assert w.one_copy_runs_intact()
    mounts = flat_hosts.ssh("hosta", "cat /proc/self/mountinfo").stdout
    assert "flat-mem-fail" not in mounts and not os.path.exists(flat_hosts.path("hosta", "images", "flat-mem-fail"))
