"""The protect unit under a REAL systemd (issue 43, 1: "systemd's stop and timeout of the unit"): host ``node`` runs
systemd as PID 1 of its own namespaces (tests/hosts/systemd_node.py), ``replica`` keeps the images. The role
gpuckpt.fleet.protect, applied with ansible-playbook, finds systemd there and installs and starts the job's units
itself; the test starts the job's service as its timer would and, while the run holds the job frozen (the libcuda
TEST DOUBLE holds its checkpoint call: tests/fakecuda/fakecuda.c, "hold"), lets systemd end it:

- ``systemctl stop``: KillMode=mixed sends SIGTERM to the runner alone; it undoes the checkpoint and exits.
- a stop whose run cannot end within TimeoutStopSec (the role's gpuckpt_protect_stop_timeout): systemd SIGKILLs it,
  and ExecStopPost's ``gpuckpt-protect give-back`` gives the job back.
- the runner SIGKILLed alone while it holds the job (what an OOM kill does): ExecStopPost gives it back.

Each ends with exactly one copy counting on from its last count (no count written twice), its memory intact,
nothing left frozen or recorded; the unit's next run checkpoints the job as before. Skipped where systemd cannot
run as PID 1 of a namespace (the reason says why).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from loopback_workloads import RemoteWorkload, fakecuda_host_vars
from systemd_node import SystemdDidNotStart, SystemdHosts, why_systemd_cannot_run

PROTECT = "gpuckpt.fleet.protect"
HOSTS = (("node", "127.0.0.81"), ("replica", "127.0.0.82"))  # apart from other tests' hosts
JOB = "held"
UNIT = "gpuckpt-protect-%s.service" % JOB
STOP_TIMEOUT = 5  # gpuckpt_protect_stop_timeout: long enough for a stopped run to undo its checkpoint and exit
HOLD_MS = 120000  # a checkpoint call held this long cannot end within STOP_TIMEOUT: the test ends it first


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = why_systemd_cannot_run()
    if why:
        pytest.skip(why)
    base = str(tmp_path_factory.mktemp("fleet"))
    host_vars = fakecuda_host_vars(base, names=[n for n, unused in HOSTS])
    for name in host_vars:
        host_vars[name].update({
            "gpuckpt_protect_dir": os.path.join(base, name, "protect"),
            "gpuckpt_protect_lib_dir": os.path.join(base, name, "lib"),
            "gpuckpt_protect_bin": os.path.join(base, name, "bin", "gpuckpt-protect"),
            "gpuckpt_protect_image_root": os.path.join(base, name, "protect-images"),
            "gpuckpt_protect_replica_root": os.path.join(base, name, "replicas"),
            "gpuckpt_protect_stop_timeout": STOP_TIMEOUT,
            "gpuckpt_protect_fence_interval": 0})  # (its own timer would give the job back before ExecStopPost)
    host_vars["node"]["gpuckpt_protect_replicas"] = ["replica"]
    h = SystemdHosts(base, systemd_hosts=["node"], hosts=HOSTS)
    try:
        h.start(host_vars)
    except SystemdDidNotStart as exc:
        h.stop()
        pytest.skip(str(exc))
    except BaseException:
        h.stop()
        raise
    h.host_vars = host_vars
    yield h
    h.stop()


def unit_state(fleet):
    """The service's state as systemd reports it (ActiveState, SubState, Result, ExecMainCode, ...)."""
    out = fleet.systemctl("node", "show", UNIT, "-p", "ActiveState,SubState,Result,ExecMainCode,ExecMainStatus,"
                          "ExecMainPID,ExecStopPost").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for_unit(fleet, states, timeout):
    """Wait until the service's (ActiveState, SubState) is one of ``states``; returns its state."""
    deadline = time.monotonic() + timeout
    while True:
        s = unit_state(fleet)
        if (s.get("ActiveState"), s.get("SubState")) in states or s.get("ActiveState") in states:
            return s
        if time.monotonic() > deadline:
            raise AssertionError("%s did not reach %s: %s" % (UNIT, states, s))
        time.sleep(0.05)


def calls(fakecuda):
    try:
        with open(os.path.join(fakecuda, "calls.log")) as fh:
            return [line.split()[0] for line in fh if line.strip()]
    except FileNotFoundError:
        return []


def wait_for_call(fakecuda, call, since, timeout=30):
    deadline = time.monotonic() + timeout
    while call not in calls(fakecuda)[since:]:
        assert time.monotonic() < deadline, "the runner made no %s call" % call
        time.sleep(0.02)


def history(fleet):
    path = os.path.join(fleet.host_vars["node"]["gpuckpt_protect_dir"], "state", JOB, "history.jsonl")
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def records(fleet):
    """The records of runs that hold the job (a run's journal while it holds it frozen)."""
    hold = os.path.join(fleet.host_vars["node"]["gpuckpt_protect_dir"], "state", JOB, "hold")
    return sorted(f for f in os.listdir(hold) if f.endswith(".source.json")) if os.path.isdir(hold) else []


def start_held_run(fleet, fakecuda):
    """Start the service as its timer does, with the driver's checkpoint call held: returns once the run holds the
    job frozen (every CUDA process checkpointed, the call not returned)."""
    with open(os.path.join(fakecuda, "hold"), "w") as fh:
        fh.write("checkpoint 0 %d\n" % HOLD_MS)
    since = len(calls(fakecuda))
    fleet.systemctl("node", "start", "--no-block", UNIT)
    wait_for_call(fakecuda, "checkpoint", since)
    state = unit_state(fleet)
    assert state["ActiveState"] == "activating" and records(fleet), (state, records(fleet))


def release_hold(fakecuda):
    try:
        os.unlink(os.path.join(fakecuda, "hold"))
    except FileNotFoundError:
        pass


def test_systemd_stopping_the_unit_while_its_run_holds_the_job_gives_the_job_back(playbook, fleet, tmp_path):
    """The role's unit under a real systemd, stopped while its run holds the job frozen: by ``systemctl stop``
    (SIGTERM to the runner), past TimeoutStopSec (SIGKILL, then ExecStopPost), and with its runner SIGKILLed alone.
    Each time one copy counts on from its last count, nothing frozen, no record left; then the unit's next run
    checkpoints the job as before."""
    w = RemoteWorkload(fleet, "node", str(tmp_path / JOB), mb=32)
    fakecuda = fleet.host_vars["node"]["gpuckpt_environment"]["FAKECUDA_STATE_DIR"]
    try:
        fleet.ssh("node", "echo %d > %s" % (w.pid, os.path.join(w.dir, "job.pid")))
        job = {"name": JOB, "pid_file": os.path.join(w.dir, "job.pid"), "interval": 3600, "keep": 1,
               "progress_file": os.path.join(w.dir, "parent.state"), "progress_key": "count"}
        run = playbook(PROTECT, {"node": "node", "gpuckpt_protected_jobs": [job]},
                       inventory=fleet.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        # The role found systemd and installed the unit with the settings that say what a stop does.
        unit = fleet.systemctl("node", "cat", UNIT).stdout
        for setting in ("KillMode=mixed", "TimeoutStopSec=%d" % STOP_TIMEOUT, "ExecStopPost="):
            assert setting in unit, unit
        assert fleet.systemctl("node", "is-active", "gpuckpt-protect-%s.timer" % JOB).stdout.strip() == "active"

        # 1. systemctl stop: SIGTERM to the runner alone; it ends the held call, undoes the checkpoint and exits.
        start_held_run(fleet, fakecuda)
        fleet.systemctl("node", "stop", "--no-block", UNIT)
        wait_for_unit(fleet, [("deactivating", "stop-sigterm")], 10)  # SIGTERM sent; the runner is in the call
        release_hold(fakecuda)
        state = wait_for_unit(fleet, ["inactive", "failed"], 30)
        assert state["Result"] != "timeout" and state["ExecMainCode"] == "1", state  # (1: CLD_EXITED, by itself)
        last = history(fleet)[-1]
        assert last["result"] == "failed" and "SIGTERM" in (last.get("reason") or ""), last
        assert not records(fleet)
        assert w.one_copy_runs_intact(), "after systemctl stop"
        w.no_count_twice()

        # 2. A stop whose run cannot end in TimeoutStopSec: systemd SIGKILLs it; ExecStopPost gives the job back.
        start_held_run(fleet, fakecuda)
        stopped = time.monotonic()
        fleet.systemctl("node", "stop", "--no-block", UNIT)
        try:
            state = wait_for_unit(fleet, ["inactive", "failed"], STOP_TIMEOUT + 30)
            took = time.monotonic() - stopped
        finally:
            release_hold(fakecuda)
        assert state["Result"] == "timeout" and state["ExecMainCode"] == "2" and state["ExecMainStatus"] == "9", state
        assert took >= STOP_TIMEOUT - 0.5, took  # (it waited the unit's TimeoutStopSec, then SIGKILL)
        assert "code=exited ; status=0 }" in state["ExecStopPost"], state  # the give-back ended well
        last = history(fleet)[-1]
        assert last["result"] == "given_back", last
        assert not records(fleet)
        assert w.one_copy_runs_intact(), "after the stop's timeout"
        w.no_count_twice()

        # 3. The runner SIGKILLed alone while it holds the job (what an OOM kill does): ExecStopPost gives it back.
        start_held_run(fleet, fakecuda)
        try:
            fleet.systemctl("node", "kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
            state = wait_for_unit(fleet, ["inactive", "failed"], 30)
        finally:
            release_hold(fakecuda)
        assert state["ExecMainCode"] == "2" and state["ExecMainStatus"] == "9", state
        assert "code=exited ; status=0 }" in state["ExecStopPost"], state
        assert history(fleet)[-1]["result"] == "given_back", history(fleet)[-1]
        assert not records(fleet)
        assert w.one_copy_runs_intact(), "after the runner's SIGKILL"
        w.no_count_twice()

        # The unit's next run (as its timer starts it) checkpoints the job as before: nothing was left to give back.
        fleet.systemctl("node", "start", UNIT)
        last = history(fleet)[-1]
        assert last["result"] == "ok" and list(last["replicas"].values()) == ["verified"], last
        assert unit_state(fleet)["Result"] == "success"
        assert w.one_copy_runs_intact(), "after the next run"
        w.no_count_twice()
    finally:
        release_hold(fakecuda)
        w.kill()
