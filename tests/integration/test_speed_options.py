"""The speed options on a real workload with real CRIU, through ansible-playbook: the quiesce hook
(the workload releases a cache before the freeze) and transparent huge pages held for the operation.

The GPU stage runs against the libcuda TEST DOUBLE (tests/fakecuda); on a GPU the same hook releases
PyTorch's cached blocks (tests/gpu, bench/gpu_bench.py --speed)."""
from __future__ import annotations

import os
import time

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import hugepages

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
CACHE_MB = 64


def _ckpt(playbook, fakecuda, pid, image_dir, **extra):
    return playbook(CHECKPOINT, dict({"gpuckpt_pid": pid, "gpuckpt_image_dir": image_dir}, **extra), env=fakecuda.env)


def test_a_quiesced_workload_makes_a_smaller_image_and_goes_on_intact(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda, cache_mb=CACHE_MB, quiesce=True)
    full = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "full"), gpuckpt_leave_running=True)
    assert full.rc == 0, full.stdout
    full_bytes = full.task("Checkpoint pid")["image_bytes"]

    run = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "img"), gpuckpt_quiesce_signal="SIGUSR1")
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint pid")
    q = res["quiesce"]
    # Each CUDA process was asked (the double registers the parent and its child) and answered.
    assert q["signal"] == "SIGUSR1" and sorted(q["pids"]) == sorted(w.pids)
    assert sorted(int(p) for p in q["acknowledged"]) == sorted(w.pids), q
    assert all(a["released_bytes"] == CACHE_MB * 2**20 for a in q["acknowledged"].values())
    assert "warning" not in q
    # What was released is not saved: about CACHE_MB per process less.
    saved = full_bytes - res["image_bytes"]
    assert saved > 0.8 * len(w.pids) * CACHE_MB * 2**20, (full_bytes, res["image_bytes"])
    stopped_at = w.counts()
    assert not w.alive()

    run = playbook(RESTORE, {"gpuckpt_image_dir": str(tmp_path / "img")}, env=fakecuda.env)
    assert run.rc == 0, run.stdout
    after = w.wait_counting(beyond=stopped_at)
    for role in w.roles:
        assert stopped_at[role] < after[role] < stopped_at[role] + 200
    assert w.intact()
    assert len(w.alive()) == len(w.pids)


def test_a_workload_that_does_not_handle_the_signal_is_never_sent_it(tmp_path, playbook, workloads, fakecuda):
    """SIGUSR1's default action kills: a process without a handler is refused before anything is sent."""
    w = workloads(fakecuda=fakecuda)
    before = w.counts()
    run = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "img"), gpuckpt_quiesce_signal="USR1")
    assert run.rc != 0
    res = run.task("Checkpoint pid")
    assert res["stage"] == "preflight" and "do not handle SIGUSR1" in res["msg"], res["msg"]
    assert not os.path.exists(str(tmp_path / "img"))
    assert [c for c, unused in fakecuda.calls() if c not in ("attach", "state")] == []
    assert w.alive() == w.pids
    w.wait_counting(beyond=before)
    assert w.intact()

    for bad in ("SIGKILL", "SIGSTOP", "NOPE"):
        run = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "img"), gpuckpt_quiesce_signal=bad)
        assert run.rc != 0 and run.task("Checkpoint pid")["stage"] == "preflight"
    assert w.alive() == w.pids and w.is_counting()


def test_a_failing_quiesce_command_freezes_nothing(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    run = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "img"), gpuckpt_quiesce_command="sh -c 'exit 3'")
    assert run.rc != 0
    res = run.task("Checkpoint pid")
    assert res["stage"] == "quiesce" and "rc=3" in res["msg"] and "nothing was frozen" in res["msg"]
    assert not os.path.exists(str(tmp_path / "img"))
    assert "lock" not in [c for c, unused in fakecuda.calls()]
    assert w.alive() == w.pids and w.is_counting() and w.intact()

    # One that succeeds runs inside the workload (its root and cwd) before the freeze.
    run = _ckpt(playbook, fakecuda, w.pid, str(tmp_path / "img2"), gpuckpt_leave_running=True,
                gpuckpt_quiesce_command=["sh", "-c", "echo quiet; cat /proc/self/status | grep -c NSpid"])
    assert run.rc == 0, run.stdout
    q = run.task("Checkpoint pid")["quiesce"]
    assert q["rc"] == 0 and q["stdout"].startswith("quiet")
    assert w.alive() == w.pids and w.is_counting()


def test_huge_pages_are_held_for_the_operation_and_put_back(tmp_path, playbook, workloads, fakecuda):
    mode = hugepages.read_mode()
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w.pid, image_dir, gpuckpt_host_huge_pages=True)
    assert run.rc == 0, run.stdout
    hp = run.task("Checkpoint pid")["huge_pages"]
    assert hp["mode"] == "always" and hp["previous"] == mode and hp["put_back"] == mode
    assert hugepages.read_mode() == mode
    stopped_at = w.counts()
    run = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_host_huge_pages": True}, env=fakecuda.env)
    assert run.rc == 0, run.stdout
    assert run.task("Restore from")["huge_pages"]["put_back"] == mode
    assert hugepages.read_mode() == mode
    w.wait_counting(beyond=stopped_at)
    assert w.intact()
    time.sleep(0.1)
    assert [n for n in os.listdir(hugepages.STATE_DIR) if n.startswith("holder-")] == []
