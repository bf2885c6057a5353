"""Checkpoint and restore a real two-process workload with real CRIU through ansible-playbook.

The GPU stage runs against the libcuda TEST DOUBLE (tests/fakecuda): CI has no GPU. The workload
calls the double's blocking sync once per tick, so it really stops counting while locked.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

from helpers import REPO, alive

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"


def _ckpt(playbook, fakecuda, pid, image_dir, check=False, **extra):
    v = {"gpuckpt_pid": pid, "gpuckpt_image_dir": image_dir}
    v.update(extra)
    return playbook(CHECKPOINT, v, check=check, env=fakecuda.env if fakecuda else None)


def _restore(playbook, fakecuda, image_dir, check=False, **extra):
    v = {"gpuckpt_image_dir": image_dir}
    v.update(extra)
    return playbook(RESTORE, v, check=check, env=fakecuda.env if fakecuda else None)


def test_checkpoint_then_restore_resumes_counting_with_memory_intact(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")

    run = _ckpt(playbook, fakecuda, w.pid, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint pid")
    assert res["changed"] is True
    assert sorted(res["cuda_pids"]) == sorted(w.pids)
    assert res["gpu_stage"] == "done"
    assert not w.alive(), "the workload must be gone after a checkpoint without leave_running"
    stopped_at = w.counts()
    assert os.stat(image_dir).st_mode & 0o777 == 0o700
    # Every lock comes before any checkpoint (consistent freeze of the whole workload).
    calls = [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")]
    assert calls == ["lock"] * len(w.pids) + ["checkpoint"] * len(w.pids), calls

    again = _ckpt(playbook, fakecuda, w.pid, image_dir)
    assert again.rc == 0, again.stdout
    assert again.task("Checkpoint pid")["changed"] is False

    time.sleep(0.5)
    assert w.counts() == stopped_at, "nothing may count while the workload is checkpointed"

    run = _restore(playbook, fakecuda, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Restore from")
    assert res["changed"] is True
    assert sorted(res["pids"]) == sorted(w.pids)
    assert set(res["timings"]) >= {"verify", "runtime_restore", "cuda_restore", "cuda_unlock", "validate"}
    after = w.wait_counting(beyond=stopped_at)
    # It goes on from where it stopped: not reset, and no tick was lost or invented.
    for role in w.roles:
        assert stopped_at[role] < after[role] < stopped_at[role] + 200
    assert w.intact()
    assert all(fakecuda.state(p) == "running" for p in w.pids)

    again = _restore(playbook, fakecuda, image_dir)
    assert again.rc == 0, again.stdout
    assert again.task("Restore from")["changed"] is False
    checked = _restore(playbook, fakecuda, image_dir, check=True)
    assert checked.rc == 0 and checked.task("Restore from")["changed"] is False
    assert w.is_counting()
    assert len(w.alive()) == len(w.pids)


def test_leave_running_never_stops_and_a_second_copy_is_refused(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    before = w.counts()
    run = _ckpt(playbook, fakecuda, w.pid, image_dir, gpuckpt_leave_running=True)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint pid")
    assert res["changed"] is True and res["leave_running"] is True
    assert w.alive() == w.pids
    assert all(fakecuda.state(p) == "running" for p in w.pids)
    w.wait_counting(beyond=before)
    assert w.is_counting()
    assert w.intact()

    # The original still runs: restoring its image here would start a second copy.
    run = _restore(playbook, fakecuda, image_dir)
    assert run.rc != 0
    res = run.task("Restore from")
    assert res["stage"] == "preflight"
    assert "in use" in res["msg"] and "second copy" in res["msg"]
    assert w.alive() == w.pids and w.is_counting()


def test_check_mode_changes_nothing(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w.pid, image_dir, check=True)
    assert run.rc == 0, run.stdout
    assert run.task("Checkpoint pid")["changed"] is True
    assert not os.path.exists(image_dir)
    assert [c for c, unused in fakecuda.calls() if c != "attach"] == []
    assert w.is_counting()


def test_injected_checkpoint_failure_on_second_pid_rolls_back(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    second = w.pids[1]
    fakecuda.inject("checkpoint", second, 2)  # CUDA_ERROR_OUT_OF_MEMORY
    run = _ckpt(playbook, fakecuda, w.pid, image_dir)
    assert run.rc != 0
    res = run.task("Checkpoint pid")
    assert res["stage"] == "checkpoint"
    assert res["pid"] == second
    assert res["driver_error"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in res["msg"] and str(second) in res["msg"]
    assert res["rolled_back"] is True
    assert all(fakecuda.state(p) == "running" for p in w.pids), "every pid must be unlocked again"
    assert not os.path.exists(image_dir)
    assert w.alive() == w.pids and w.is_counting() and w.intact()
    # The first pid was checkpointed, so it was restored before everything was unlocked.
    calls = [c for c in fakecuda.calls() if c[0] != "attach"]
    assert ("restore", str(w.pids[0])) in calls
    assert calls[-len(w.pids):] == [("unlock", str(p)) for p in w.pids]


def test_failure_at_criu_dump_rolls_back(tmp_path, playbook, workloads, fakecuda):
    """A real CRIU failure: the image directory is a 1 MiB tmpfs, too small for the pages."""
    w = workloads(fakecuda=fakecuda, mb=16)
    image_dir = str(tmp_path / "small")
    os.mkdir(image_dir)
    assert os.system("mount -t tmpfs -o size=1m gpuckpt-test %s" % image_dir) == 0
    try:
        run = _ckpt(playbook, fakecuda, w.pid, image_dir)
        assert run.rc != 0
        res = run.task("Checkpoint pid")
        assert res["stage"] == "criu-dump"
        assert res["rolled_back"] is True
        assert "criu" in res["cmd"][0] and res["rc"] != 0
        assert "dump.log" in res["stderr"]
        assert all(fakecuda.state(p) == "running" for p in w.pids)
        assert w.alive() == w.pids and w.is_counting() and w.intact()
        assert os.listdir(image_dir) == [], "a failed checkpoint leaves no partial image behind"
    finally:
        os.system("umount %s" % image_dir)


def test_cpu_only_workload_skips_the_gpu_stage(tmp_path, playbook, workloads):
    """No driver on this host (no test double either): CRIU alone, and the result says so."""
    w = workloads()
    image_dir = str(tmp_path / "img")
    env = {"GPUCKPT_LIBCUDA": str(tmp_path / "no-such-libcuda.so.1")}
    run = playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir}, env=env)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint pid")
    assert res["gpu_stage"].startswith("skipped: no CUDA driver")
    assert res["cuda_pids"] == []
    stopped_at = w.counts()
    run = playbook(RESTORE, {"gpuckpt_image_dir": image_dir}, env=env)
    assert run.rc == 0, run.stdout
    w.wait_counting(beyond=stopped_at)
    assert w.intact()
    assert all(alive(p) for p in w.pids)


# What the CUDA child does with its second argument: map it as a shared-memory segment, or load it.
MAP_SHM = "f=open(sys.argv[2],'w+b'); f.truncate(4096); m=mmap.mmap(f.fileno(), 4096)"
LOAD_LIB = "ctypes.CDLL(sys.argv[2])"


def _cuda_child(fakecuda, action, path, env=None):
    """A process registered with the libcuda test double that maps or loads ``path``, then waits,
    calling the double's blocking sync (so a lock would freeze it). Returns it once it is up."""
    code = ("import ctypes,mmap,sys,time; l=ctypes.CDLL(sys.argv[1]); l.fakeCudaAttach(); %s; "
            "print('up', flush=True); [time.sleep(0.05) or l.fakeCudaSync() for unused in range(6000)]" % action)
    # Its own session (CRIU dumps a session only with its leader) and none of pytest's stdio: a CI
    # runner's stdio can be files it holds locks on, which CRIU refuses to dump (seen in CI).
    child = subprocess.Popen([sys.executable, "-c", code, fakecuda.lib, str(path)], stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env=dict(os.environ, **dict(fakecuda.env, **(env or {}))))
    assert child.stdout.readline().strip() == b"up"
    return child


def test_nccl_job_is_refused_before_anything_is_frozen(tmp_path, playbook, workloads, fakecuda):
    """The driver checkpoints NCCL ranks but cannot restore them (seen on driver 580.159.04), so a
    process with live NCCL communicators is refused in preflight. Here the "communicator" is what the
    check reads: a mapped /dev/shm/nccl-* segment, as NCCL maps for its transports and proxy."""
    w = workloads(fakecuda=fakecuda)
    shm = "/dev/shm/nccl-gpuckpt-test-%d" % os.getpid()
    child = _cuda_child(fakecuda, MAP_SHM, shm)
    try:
        run = _ckpt(playbook, fakecuda, child.pid, str(tmp_path / "img"))
        assert run.rc != 0
        res = run.task("Checkpoint pid")
        assert res["stage"] == "preflight" and "NCCL" in res["msg"] and "nothing was frozen" in res["msg"]
        assert not [c for c, p in fakecuda.calls() if c == "lock"], "nothing may be locked"
        assert fakecuda.state(child.pid) == "running"
    finally:
        child.kill()
        child.wait()
        os.unlink(shm)
    assert w.is_counting()


def test_a_launched_distributed_rank_with_nccl_is_refused(tmp_path, playbook, fakecuda):
    """A rank started by a launcher (WORLD_SIZE > 1) that has libnccl loaded is refused in preflight."""
    nccl = tmp_path / "libnccl.so.2"
    shutil.copy(fakecuda.lib, nccl)
    child = _cuda_child(fakecuda, LOAD_LIB, nccl, env={"WORLD_SIZE": "2", "RANK": "0"})
    try:
        run = _ckpt(playbook, fakecuda, child.pid, str(tmp_path / "img"))
        res = run.task("Checkpoint pid")
        assert run.rc != 0 and res["stage"] == "preflight" and "NCCL" in res["msg"]
        assert fakecuda.state(child.pid) == "running"
    finally:
        child.kill()
        child.wait()


def test_cuda_ipc_memory_is_refused(tmp_path, playbook, fakecuda):
    """Producer and consumer of CUDA IPC memory map CUDA's /dev/shm/cuda.shm.* segment."""
    shm = "/dev/shm/cuda.shm.0.gpuckpt-test.%d" % os.getpid()
    child = _cuda_child(fakecuda, MAP_SHM, shm)
    try:
        run = _ckpt(playbook, fakecuda, child.pid, str(tmp_path / "img"))
        res = run.task("Checkpoint pid")
        assert run.rc != 0 and res["stage"] == "preflight" and "CUDA IPC memory" in res["msg"]
        assert not [c for c, p in fakecuda.calls() if c == "lock"]
    finally:
        child.kill()
        child.wait()
        os.unlink(shm)


def test_a_loaded_but_unused_libnccl_is_fine(tmp_path, playbook, fakecuda):
    """Every PyTorch process maps libnccl; that alone must not refuse the checkpoint."""
    nccl = tmp_path / "libnccl.so.2"
    shutil.copy(fakecuda.lib, nccl)
    child = _cuda_child(fakecuda, LOAD_LIB, nccl)
    try:
        run = _ckpt(playbook, fakecuda, child.pid, str(tmp_path / "img"), gpuckpt_leave_running=True)
        assert run.rc == 0, run.stdout
        assert run.task("Checkpoint pid")["cuda_pids"] == [child.pid]
        assert fakecuda.state(child.pid) == "running"
    finally:
        child.kill()
        child.wait()


def test_parallel_driver_calls_keep_the_consistent_freeze(tmp_path, workloads, fakecuda):
    """Engine option: checkpoint/restore the CUDA processes on one thread each. Locks stay first."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore
    w = workloads(fakecuda=fakecuda, children=3)
    image_dir = str(tmp_path / "img")
    res = checkpoint(w.pid, image_dir, parallel=True)
    assert sorted(res["cuda_pids"]) == sorted(w.pids)
    calls = [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")]
    assert calls == ["lock"] * 4 + ["checkpoint"] * 4
    stopped = w.counts()
    restore(image_dir, parallel=True)
    w.wait_counting(beyond=stopped)
    assert w.intact()


# -- a distributed (NCCL) job, checkpointable by its configuration (issue 45) ------------------------------------
NCCL_RANKS = os.path.join(REPO, "tests", "workloads", "nccl_ranks.py")
RESTORABLE_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0",
                   "NCCL_NVLS_ENABLE": "0"}


class NcclJob(object):
    """tests/workloads/nccl_ranks.py: a launcher with its TCP store and 2 ranks of the libcuda TEST DOUBLE sharing
    /dev/shm/nccl-<tag>, each counting into <dir>/rank<N>.count."""

    def __init__(self, directory, fakecuda, env, hello=False):
        self.dir, self.tag = directory, "gpuckpt-test-%s" % uuid.uuid4().hex[:8]
        cmd = [sys.executable, NCCL_RANKS, "--dir", directory, "--fakecuda", fakecuda.lib, "--tag", self.tag, "--daemon"]
        subprocess.run(cmd + (["--hello"] if hello else []),
                       env=dict({k: v for k, v in os.environ.items() if not k.startswith("NCCL_")},
                                **dict(fakecuda.env, **env)), check=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (self.counts()[0] > 2 and self.counts()[1] > 2):
            time.sleep(0.05)
        assert self.counts()[0] > 2 and self.counts()[1] > 2, "the ranks do not count"
        with open(os.path.join(directory, "launcher.pid")) as fh:
            self.pid = int(fh.read())

    def counted(self, r):
        try:
            with open(os.path.join(self.dir, "rank%d.count" % r)) as fh:
                return [int(x) for x in fh.read().split()]
        except OSError:
            return []

    def counts(self):
        return [(self.counted(r) or [0])[-1] for r in range(2)]

    def counting_on(self, beyond, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(c > b + 2 for c, b in zip(self.counts(), beyond)):
                return True
            time.sleep(0.05)
        return False

    def no_count_twice(self):
        for r in range(2):
            seen = self.counted(r)
            assert seen == list(range(seen[0], seen[0] + len(seen))), "rank %d counted %s" % (r, seen[-20:])

    def kill(self):
        for d in os.listdir("/proc"):
            try:
                with open("/proc/%s/cmdline" % d, "rb") as fh:
                    if self.tag.encode() in fh.read():
                        os.kill(int(d), 9)
            except (OSError, ValueError):
                pass
        if os.path.exists("/dev/shm/nccl-" + self.tag):
            os.unlink("/dev/shm/nccl-" + self.tag)


def test_an_nccl_job_started_as_the_driver_can_restore_is_checkpointed_and_restored(tmp_path, playbook, fakecuda):
    """Both ranks locked before any is checkpointed, the launcher's rendezvous connections (both ends in the tree)
    dumped without the user naming tcp_established, restored, and every rank counting on from its count.
    Restored in place at once: the store's port still has the TIME_WAIT sockets of the ranks' hellos (closed by the
    store first), which would fail CRIU's bind ("Address already in use"); the restore waits them out first."""
    job = NcclJob(str(tmp_path / "job"), fakecuda, RESTORABLE_NCCL, hello=True)
    image_dir = str(tmp_path / "img")
    try:
        run = _ckpt(playbook, fakecuda, job.pid, image_dir)
        assert run.rc == 0, run.stdout
        res = run.task("Checkpoint pid")
        assert len(res["cuda_pids"]) == 2 and res["gpu_stage"] == "done", res
        calls = [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")]
        assert calls == ["lock", "lock", "checkpoint", "checkpoint"], calls
        with open(os.path.join(image_dir, "manifest.json")) as fh:
            manifest = json.load(fh)
        assert "--tcp-established" in manifest["runtime"]["auto_flags"]
        store_port = manifest["target"]["tcp_listen_ports"]
        assert len(store_port) == 1, manifest["target"]
        held = job.counts()
        time.sleep(0.3)
        assert job.counts() == held
        run = _restore(playbook, fakecuda, image_dir)
        assert run.rc == 0, run.stdout
        waited = run.task("Restore from")["tcp_time_wait"]
        assert waited["ports"] == store_port and waited["cleared"] and 0 < waited["waited_s"] < 66, waited
        assert job.counting_on(held), (held, job.counts())
        job.no_count_twice()
    finally:
        job.kill()


def test_an_nccl_job_with_ncclss_defaults_is_refused_naming_what_makes_it_checkpointable(
        tmp_path, playbook, fakecuda):
    job = NcclJob(str(tmp_path / "job"), fakecuda, {})
    try:
        run = _ckpt(playbook, fakecuda, job.pid, str(tmp_path / "img"), gpuckpt_tcp_established=True)
        res = run.task("Checkpoint pid")
        assert run.rc != 0 and res["stage"] == "preflight" and "nothing was frozen" in res["msg"], res
        assert "NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0" in res["msg"] and "rank 0 of 2" in res["msg"], res["msg"]
        assert not [c for c, unused in fakecuda.calls() if c == "lock"], "nothing may be locked"
        assert job.counting_on(job.counts())
    finally:
        job.kill()
