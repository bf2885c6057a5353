"""A runc container, checkpointed and restored through the playbooks: real runc 1.1.5 driving real
CRIU 4.1.1. Inside the container a parent and a child count and hold a memory pattern, registered
with the libcuda TEST DOUBLE, so the CUDA stage runs on the container's host pids as it does on a GPU
node (the driver resolves host pids)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from helpers import COUNTER, FAKE_LIBCUDA, CountingWorkload, alive, tree, write_runc_bundle

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
RUNC = shutil.which("runc")
pytestmark = pytest.mark.skipif(RUNC is None, reason="runc is not installed (tests/setup.sh installs it)")


class RuncWorkload(CountingWorkload):
    """A runc container (its bundle binds /usr and /etc read-only, the repo and the work dir at their
    host paths, so the test double finds its library at the same path) running tests/workloads/counter.py."""

    roles = ("parent", "child1")

    def __init__(self, base, fakecuda):
        self.base, self.dir = base, os.path.join(base, "w")
        self.root, self.bundle = os.path.join(base, "runc-root"), os.path.join(base, "bundle")
        self.id = "gpuckpt-t-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        write_runc_bundle(self.bundle, ["/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                                        "--fakecuda", FAKE_LIBCUDA],
                          env=["%s=%s" % kv for kv in fakecuda.env.items()], rw=[self.dir, fakecuda.state_dir])
        self.start()

    def runc(self, *args, check=True):
        return subprocess.run([RUNC, "--root", self.root] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, check=check)

    def start(self):
        # CRIU dumps a container whose stdio are pipes, never host files: a relay reads them.
        log = open(os.path.join(self.base, "container.log"), "ab")
        relay = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
        subprocess.run([RUNC, "--root", self.root, "run", "--detach", "--bundle", self.bundle, self.id],
                       stdin=subprocess.DEVNULL, stdout=relay.stdin, stderr=relay.stdin, check=True)
        relay.stdin.close()
        log.close()
        self.wait_counting()

    def state(self):
        res = self.runc("state", self.id, check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def host_pids(self):
        return tree(int(self.state()["pid"]))

    def stop(self):
        self.runc("delete", "--force", self.id, check=False)


@pytest.fixture
def runc_workload(tmp_path, fakecuda):
    made = []

    def make():
        w = RuncWorkload(str(tmp_path / ("c%d" % len(made))), fakecuda)
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop()


def _ckpt(playbook, fakecuda, w, image_dir, **extra):
    v = {"gpuckpt_container": w.id, "gpuckpt_runc_root": w.root, "gpuckpt_image_dir": image_dir}
    v.update(extra)
    return playbook(CHECKPOINT, v, env=fakecuda.env)


def _restore(playbook, fakecuda, w, image_dir):
    return playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root}, env=fakecuda.env)


def test_container_checkpoint_then_restore_counts_on_with_memory_intact(tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    host_pids = w.host_pids()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint container")
    assert res["changed"] is True and res["gpu_stage"] == "done"
    assert sorted(res["cuda_pids"]) == sorted(host_pids)  # the driver is called with host pids
    locks = [p for c, p in fakecuda.calls() if c == "lock"]
    assert len(locks) == 2 and {int(p) for p in locks} == set(res["cuda_pids"])
    assert w.state() is None, "runc checkpoint removes the container"
    assert not any(alive(p) for p in res["cuda_pids"])
    stopped_at = w.counts()

    again = _ckpt(playbook, fakecuda, w, image_dir)
    assert again.rc == 0 and again.task("Checkpoint container")["changed"] is False

    run = _restore(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and len(rs["cuda_pids"]) == 2
    assert w.state()["status"] == "running"
    assert all(fakecuda.state(p) == "running" for p in rs["cuda_pids"])
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]

    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc == 0 and second.task("Restore from")["changed"] is False


def test_container_leave_running_never_stops_and_a_restore_beside_it_is_refused(
        tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir, gpuckpt_leave_running=True)
    assert run.rc == 0, run.stdout
    assert w.state()["status"] == "running" and w.is_counting()
    res = run.task("Checkpoint container")
    assert all(fakecuda.state(p) == "running" for p in res["cuda_pids"])
    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc != 0
    assert "already exists on this host; refusing to start a second copy" in second.task("Restore from")["msg"]
    assert w.is_counting()


def test_unknown_container_is_refused_and_nothing_is_written(tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, {"gpuckpt_container": "no-such-container", "gpuckpt_runc_root": w.root,
                                "gpuckpt_image_dir": image_dir}, env=fakecuda.env)
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight" and "no runc container 'no-such-container'" in res["msg"]
    assert not os.path.exists(image_dir) and w.is_counting()


def test_a_failed_container_dump_leaves_it_running_and_unlocked(tmp_path, playbook, runc_workload, fakecuda):
    """runc's CRIU fails (the image dir's filesystem is 1 MiB): the engine restores and unlocks the CUDA
    processes and the container runs on."""
    w = runc_workload()
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "gpuckpt-small", str(small)], check=True)
    try:
        run = _ckpt(playbook, fakecuda, w, str(small / "img"))
        assert run.rc != 0
        res = run.task("Checkpoint container")
        assert res["stage"] == "runtime-dump" and res["rolled_back"] is True, res
        assert w.state()["status"] == "running" and w.is_counting()
        states = {p: fakecuda.state(p) for p in w.host_pids()}
        assert len(states) == 2 and set(states.values()) == {"running"}, (states, res)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_container_network_that_criu_cannot_lock_is_refused_before_anything_is_frozen(
        tmp_path, playbook, runc_workload, fakecuda):
    """The container has a network namespace of its own (runc's default spec), which CRIU locks with
    iptables-restore during the dump. On a host without iptables-restore (here: a PATH without
    /usr/sbin, where bookworm installs it) the dump would fail after the CUDA stage; the engine
    refuses in preflight instead: nothing is locked, nothing is written, the container counts on."""
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    path = "/usr/local/sbin:/usr/local/bin:/usr/bin:/bin"
    assert shutil.which("iptables-restore", path=path) is None
    run = playbook(CHECKPOINT, {"gpuckpt_container": w.id, "gpuckpt_runc_root": w.root, "gpuckpt_runc_path": RUNC,
                                "gpuckpt_image_dir": image_dir}, env=dict(fakecuda.env, PATH=path))
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight", res
    assert "network namespace of its own" in res["msg"] and "iptables-restore" in res["msg"]
    assert "nothing was frozen" in res["msg"] and "install iptables" in res["msg"]
    assert not os.path.exists(image_dir)
    assert [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")] == []
    assert w.state()["status"] == "running" and w.is_counting()
